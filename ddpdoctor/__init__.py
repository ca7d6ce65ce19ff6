"""ddpdoctor: diagnose PyTorch DistributedDataParallel jobs.

Importing the package must stay cheap: the CLI imports torch only where a
command needs it, so `ddpdoctor --help` and bad-argument errors are instant.
"""

__version__ = "0.1.0"
