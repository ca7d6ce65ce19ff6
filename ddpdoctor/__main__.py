"""`python -m ddpdoctor` is the same program as the `ddpdoctor` console script."""

from ddpdoctor.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
