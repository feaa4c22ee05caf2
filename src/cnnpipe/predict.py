"""`python -m cnnpipe.predict`: classify image files with a trained model (see cnnpipe.deploy.predict)."""

from cnnpipe.deploy.predict import main

if __name__ == "__main__":
    raise SystemExit(main())
