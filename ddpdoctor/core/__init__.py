"""core: the nouns every other room shares: findings, errors, the report model and its files, redaction.

May import: the standard library only (and other core modules). No torch, no rich, no pynvml:
a report can be read, judged and written where none of them is installed.
"""
