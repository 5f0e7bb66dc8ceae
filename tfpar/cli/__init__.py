"""The programs. This package is the `tfpar` console script (`tfpar train [flags]`,
`tfpar launch [flags] -- command`; `python -m tfpar.cli` runs it too); its modules: `train`
(the training binary, `python -m tfpar.cli.train`), `launch` (the local cluster launcher),
`factory` (strategies by name), `cuda_noise` (stderr without TensorFlow's CUDA probe lines)."""

import sys

_COMMANDS = {"train": "tfpar.cli.train", "launch": "tfpar.cli.launch"}


def main(argv=None):
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in _COMMANDS:
        print(f"usage: tfpar {{{','.join(_COMMANDS)}}} [flags]   (tfpar COMMAND --help for flags)",
              file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(_COMMANDS[argv[1]])
    # absl --help/--helpshort show the flags of the module named by sys.argv[0].
    sys.argv = [module.__name__] + argv[2:]
    module.entry()
    return 0

