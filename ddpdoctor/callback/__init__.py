"""callback: ddpdoctor inside a user's own training job: `Doctor` (the per-step probes), the
gathered row and its online checks, and `watch()` before init_process_group.

May import: core, measure, judge, runtime (exits), probes (the straggler scores).
"""
