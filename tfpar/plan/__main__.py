"""`python -m tfpar.plan advise|estimate`: memory per device, before building anything.

    python -m tfpar.plan advise --params 1.3e9 --devices 8 --bytes_per_device 16GiB
    python -m tfpar.plan estimate --params 7B --devices 8 --shard gradients
    python -m tfpar.plan advise --layers 50M:1GiB,3e9:1GiB,50M:1GiB --devices 16 --hosts 2 \
        --bytes_per_device 40GiB

Bad input exits with status 2 and a message that names the flag to fix.
"""

import argparse
import sys

from tfpar.plan import advisor, memory, units
from tfpar.plan.placement import LayerCost, optimizer_slots


def _flag_type(parse, minimum=0):
    """`parse` with a lower bound, for argparse, whose messages then name the flag (it hides
    a plain ValueError's message)."""
    def parse_flag(text):
        try:
            value = parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        numbers = [v for v in (value if isinstance(value, list) else [value])
                   if not isinstance(v, LayerCost)]
        if numbers and min(numbers) < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}. Received: {text!r}")
        return value

    parse_flag.__name__ = parse.__name__
    return parse_flag


def _parse_sizes(text):
    return [units.parse_count(size) for size in text.split(",")]


def _parse_layers(text):
    """"PARAMS:ACTIVATION_BYTES,..." (activation bytes optional) as LayerCost layers."""
    layers = []
    for i, item in enumerate(text.split(",")):
        params, _, activations = item.partition(":")
        layers.append(LayerCost(f"layer_{i}", units.parse_count(params), 0, 0,
                                units.parse_bytes(activations or "0")))
    return layers


def _slots_of(optimizer):
    try:
        return optimizer_slots(optimizer)
    except ValueError as err:  # Its advice names a Python argument, not a flag.
        raise ValueError(f"{err} Here: give --optimizer_slots.") from None


def _model_flags(parser):
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=_flag_type(units.parse_count, 1),
                       help="total parameters, e.g. 1.3e9 or 7B")
    model.add_argument("--sizes", type=_flag_type(_parse_sizes),
                       help="elements of each variable in model order, comma-separated "
                            "(exact ZeRO owners and pipeline cuts)")
    model.add_argument("--layers", type=_flag_type(_parse_layers),
                       help="each layer in model order as PARAMS:ACTIVATION_BYTES (the output "
                            "it keeps for the backward pass at one model copy's batch), "
                            "comma-separated, e.g. 50M:1GiB,3B:1GiB")
    parser.add_argument("--largest_variable", type=_flag_type(units.parse_count),
                        help="with --params: elements of the largest variable (ZeRO stage 3 "
                             "gathers it); default: unknown, counted as 0")
    parser.add_argument("--devices", type=_flag_type(units.parse_count, 1), required=True,
                        help="number of devices")
    parser.add_argument("--optimizer", type=_flag_type(_slots_of), default="adam",
                        dest="slots_of_optimizer", metavar="NAME",
                        help="Keras optimizer name, which sets the optimizer slots per "
                             "variable (default: adam)")
    parser.add_argument("--optimizer_slots", type=_flag_type(units.parse_count),
                        help="state copies per variable; overrides --optimizer "
                             "(e.g. 1 for SGD with momentum)")
    parser.add_argument("--dtype_bytes", type=_flag_type(units.parse_count, 1), default=4,
                        help="bytes per weight, gradient and optimizer value (default: 4)")
    parser.add_argument("--activation_bytes", type=_flag_type(units.parse_bytes), default=0,
                        help="activations one model copy keeps for the backward pass, "
                             "e.g. 2GiB (default: 0)")


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m tfpar.plan",
        description="Memory per device of training a model, before building anything.")
    commands = parser.add_subparsers(dest="command", required=True)
    advise = commands.add_parser(
        "advise", help="the data x pipe x model degrees (and ZeRO stage) that fit the "
                       "devices' memory with the least communication")
    _model_flags(advise)
    advise.add_argument("--bytes_per_device", type=_flag_type(units.parse_bytes, 1),
                        required=True,
                        help="memory of each device, e.g. 16GiB or 80GB")
    advise.add_argument("--hosts", type=_flag_type(units.parse_count, 1), default=1,
                        help="hosts the devices are spread over evenly (tensor parallelism "
                             "stays inside a host; default: 1)")
    advise.add_argument("--layer_output_bytes", type=_flag_type(units.parse_bytes),
                        help="one layer's output at one model copy's batch, for pipeline and "
                             "tensor-parallel traffic (default: from --layers)")
    advise.add_argument("--input_bytes", type=_flag_type(units.parse_bytes), default=0,
                        help="one batch of inputs and targets of one model copy")
    estimate = commands.add_parser(
        "estimate", help="bytes per device of one strategy")
    _model_flags(estimate)
    estimate.add_argument("--kind", choices=memory.KINDS, default="data",
                          help="data parallel, ZeRO-sharded, pipeline or model parallel")
    estimate.add_argument("--shard", choices=["optimizer", "gradients", "parameters"],
                          help="ZeRO stage 1, 2 or 3 (with --kind sharded; with --kind "
                               "pipeline each stage's state over its --replicas)")
    estimate.add_argument("--replicas", type=int, default=1,
                          help="with --kind pipeline: pipeline replicas (--devices counts "
                               "the stages of one)")
    estimate.add_argument("--tensor_parallel", type=int, default=1,
                          help="with --kind pipeline: devices each stage is split over "
                               "(--devices 1 for none)")
    for command in (advise, estimate):
        command.set_defaults(parser=command)
    return parser


def _run(args):
    slots = (args.optimizer_slots if args.optimizer_slots is not None
             else args.slots_of_optimizer)
    model = next(m for m in (args.params, args.sizes, args.layers) if m is not None)
    if args.command == "advise":
        return advisor.advise(model, args.devices, args.bytes_per_device, slots,
                              args.dtype_bytes, args.activation_bytes, args.largest_variable,
                              hosts=args.hosts, input_bytes=args.input_bytes,
                              layer_output_bytes=args.layer_output_bytes).explain()
    config = memory.MemoryConfig(args.kind, args.devices, args.shard, slots, args.dtype_bytes,
                                 args.activation_bytes, num_replicas=args.replicas,
                                 tensor_parallel=args.tensor_parallel)
    return memory.estimate_memory(model, config, args.largest_variable).format()


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        text = _run(args)
    except ValueError as err:
        args.parser.error(str(err))  # Prints the usage and exits with status 2.
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
