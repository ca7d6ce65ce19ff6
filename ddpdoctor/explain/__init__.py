"""explain: a failed job's logs and Flight Recorder dumps in, a report out (`ddpdoctor explain`).

read -> prefixes -> signatures -> scan -> events -> causes/collectives -> diagnosis -> command.
May import: core, judge. No torch.
"""
