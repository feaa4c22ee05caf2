"""`python -m cnnpipe.promote`: version this commit's model and put it in production, if the gate
blessed it (see cnnpipe.release.promote)."""

from cnnpipe.release.promote import main

if __name__ == "__main__":
    raise SystemExit(main())
