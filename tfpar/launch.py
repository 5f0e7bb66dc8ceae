"""Deprecated: `python -m tfpar.launch` moved (see `tfpar.cli.moved`)."""

if __name__ == "__main__":
    from tfpar.cli import moved

    moved.run("tfpar.launch")
