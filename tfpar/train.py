"""Deprecated: `python -m tfpar.train` moved (see `tfpar.cli.moved`)."""

if __name__ == "__main__":
    from tfpar.cli import moved

    moved.run("tfpar.train")
