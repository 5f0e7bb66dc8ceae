"""Memory per device before building, and the strategy advisor. Pure Python.

Expected numbers are worked out by hand from the ZeRO table (d bytes per value,
s optimizer slots, P parameters, N replicas, owned(r) the parameters replica r owns):

    stage 0: d*P + d*P + d*s*P
    stage 1: d*P + d*P + d*s*owned(r)
    stage 2: d*P + d*owned(r) + d*s*owned(r)
    stage 3: d*owned(r) * (2 + s) + d*largest variable (gather buffer)

and, at every stage, the optimizer update's temporaries (`DeviceMemory.update`):
d*(s+1) x the largest variable the device updates (under ZeRO at most owned(r) values),
0 when s = 0. Adam in fp32: 12 bytes per value of that variable.
"""

import doctest
import subprocess
import sys

import pytest

from tfpar.plan import __main__ as cli
from tfpar.plan import advisor, communication, memory, units
from tfpar.plan.advisor import advise
from tfpar.plan.memory import MemoryConfig, estimate_memory

SHARDS = [None, "optimizer", "gradients", "parameters"]


def _config(shard, n, **kwargs):
    return MemoryConfig("sharded" if shard else "data", n, shard, **kwargs)


# --- ZeRO formulas -------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("shard", SHARDS)
def test_zero_bytes_per_param_on_a_balanced_model(shard, n):
    """8 equal variables split evenly over N in {1, 2, 4, 8}: Adam in fp32 needs 16,
    8 + 8/N, 4 + 12/N and 16/N bytes per parameter (plus the gather buffer at stage 3),
    and every replica owns at least one whole variable, so its update's temporaries are
    4 * 3 of one variable's values."""
    sizes, size = [1000] * 8, 1000
    p = sum(sizes)
    per_param = {None: 16, "optimizer": 8 + 8 / n, "gradients": 4 + 12 / n,
                 "parameters": 16 / n}[shard]
    estimate = estimate_memory(sizes, _config(shard, n))
    assert len(estimate.devices) == n
    for device in estimate.devices:
        assert (device.total - device.gather_buffer - device.update) / p == per_param
        assert device.gather_buffer == (4 * size if shard == "parameters" else 0)
        assert device.update == 4 * 3 * size
    assert estimate.peak == (per_param * p + (4 * size if shard == "parameters" else 0)
                             + 4 * 3 * size)


def test_each_stage_shards_its_own_part():
    """N=4, P=8000 (each replica owns 2000), d=4, s=2: stage by stage, one more part
    drops from 4P (or 8P for the optimizer) to its owned share."""
    full, owned = 4 * 8000, 4 * 2000
    expected = {  # (weights, gradients, optimizer)
        None: (full, full, 2 * full),
        "optimizer": (full, full, 2 * owned),
        "gradients": (full, owned, 2 * owned),
        "parameters": (owned, owned, 2 * owned),
    }
    for shard, parts in expected.items():
        device = estimate_memory([1000] * 8, _config(shard, 4)).devices[0]
        assert (device.weights, device.gradients, device.optimizer) == parts, shard


@pytest.mark.parametrize("dtype_bytes,slots,per_param,update", [
    # bf16 Adam, stage 1: weights and gradients whole, 2 slots / 4; update 3 x 1000 values
    (2, 2, 2 * (2 + 2 / 4), 2 * 3 * 1000),
    (4, 0, 4 * 2, 0),  # SGD: no state to shard, stage 1 saves nothing; no update term
    (4, 1, 4 * (2 + 1 / 4), 4 * 2 * 1000),  # RMSprop: one slot; update 2 x 1000 values
])
def test_stage_one_generalizes_to_dtype_and_slots(dtype_bytes, slots, per_param, update):
    estimate = estimate_memory([1000] * 8, _config(
        "optimizer", 4, dtype_bytes=dtype_bytes, optimizer_slots=slots))
    assert [d.update for d in estimate.devices] == [update] * 4
    assert (estimate.peak - update) / 8000 == per_param


def test_one_huge_variable_sets_the_peak():
    """[1000, 10, 10, 10] over 2 replicas: the least-loaded rule gives the 1000 to
    replica 0 and the three 10s to replica 1 (load 0, 10, 20 < 1000). owned = [1000, 30].
    The owner of the 1000 also updates it: 4 * 3 * 1000 bytes of temporaries; replica 1
    is counted min(1000, 30) values."""
    sizes, p = [1000, 10, 10, 10], 1030
    update = [4 * 3 * 1000, 4 * 3 * 30]
    stage1 = estimate_memory(sizes, _config("optimizer", 2)).devices
    assert [d.update for d in stage1] == update
    assert [d.total for d in stage1] == [8 * p + 8 * 1000 + update[0],
                                         8 * p + 8 * 30 + update[1]]
    stage3 = estimate_memory(sizes, _config("parameters", 2)).devices
    gather = 4 * 1000  # Every replica gathers the largest variable in turn.
    assert [d.update for d in stage3] == update
    assert [d.total for d in stage3] == [16 * 1000 + gather + update[0],
                                         16 * 30 + gather + update[1]]
    # Far above an even split's 16 * 1030 / 2 + gather: owning whole variables costs this.
    assert stage3[0].total - update[0] > 16 * p / 2 + gather


@pytest.mark.parametrize("slots,copies", [
    (2, 3),  # Adam: the update holds 3 temporaries the size of the variable
    (1, 2),  # SGD with momentum: 2
    (0, 0),  # plain SGD: none counted
])
def test_the_update_holds_slots_plus_one_copies_of_the_largest_variable_updated(slots, copies):
    """`DeviceMemory.update` = d x (slots + 1) x the largest variable the device updates (0
    without slots). Without ZeRO every replica updates every variable: [1000, 10, 10, 10]
    counts the 1000 on both. Under ZeRO a replica updates only what it owns: the owner of
    the 1000 counts it, the replica owning the three 10s min(1000, 30) = 30 values. A
    pipeline stage counts its own largest variable, a tensor-parallel rank its part."""
    sizes = [1000, 10, 10, 10]  # ZeRO owners over 2: [1000] and [10, 10, 10] (owned 30).
    data = estimate_memory(sizes, MemoryConfig("data", 2, optimizer_slots=slots)).devices
    assert [d.update for d in data] == [4 * copies * 1000] * 2
    bf16 = MemoryConfig("data", 2, optimizer_slots=slots, dtype_bytes=2)
    assert estimate_memory(sizes, bf16).devices[0].update == 2 * copies * 1000
    devices = list(data)
    for shard in ("optimizer", "gradients", "parameters"):
        zero = estimate_memory(sizes, MemoryConfig("sharded", 2, shard,
                                                   optimizer_slots=slots)).devices
        assert [d.update for d in zero] == [4 * copies * 1000, 4 * copies * 30], shard
        devices += zero
    # Stages [400] | [200, 100, 200], each on 2 replicas without ZeRO: both replicas update
    # their stage's variables; a 2-way tensor-parallel rank updates half of each.
    pipe = estimate_memory([400, 200, 100, 200],
                           MemoryConfig("pipeline", 2, num_replicas=2, optimizer_slots=slots))
    assert [d.update for d in pipe.devices] == [4 * copies * s for s in (400, 200, 400, 200)]
    split = estimate_memory(sizes, MemoryConfig("pipeline", 1, tensor_parallel=2,
                                                optimizer_slots=slots))
    assert [d.update for d in split.devices] == [4 * copies * 500] * 2
    # Part of each device's total, so of the peak the advisor compares with a budget.
    for d in devices + list(pipe.devices) + list(split.devices):
        assert d.total == (d.weights + d.gradients + d.optimizer + d.activations
                           + d.gather_buffer + d.inputs + d.update)
    assert estimate_memory(sizes, MemoryConfig("data", 2, optimizer_slots=slots)).peak == (
        4 * (2 + slots) * 1030 + 4 * copies * 1000)


def test_a_total_only_splits_evenly_and_counts_the_largest_variable_if_given():
    # 1001 over 2: owned 501 and 500; the gather buffer is 4 * 100 when told, else 0, and
    # so is the update's (4 * 3 * 100 when told).
    config = _config("parameters", 2)
    told = estimate_memory(1001, config, largest_variable=100).devices
    assert [d.update for d in told] == [1200, 1200]
    assert [d.total for d in told] == [16 * 501 + 400 + 1200, 16 * 500 + 400 + 1200]
    assert estimate_memory(1001, config).devices[0].gather_buffer == 0
    assert estimate_memory(1001, config).devices[0].update == 0
    assert estimate_memory(1.3e9, _config(None, 8)).peak == 16 * 1_300_000_000


def test_activations_are_whole_on_every_replica():
    estimate = estimate_memory([1000] * 8, _config("parameters", 4, activation_bytes=5000))
    assert [d.activations for d in estimate.devices] == [5000] * 4
    assert estimate.peak == 16 * 2000 + 4 * 1000 + 5000 + 4 * 3 * 1000  # + the update


@pytest.mark.parametrize("kind", ["pipeline", "model"])
def test_stages_hold_their_variables_and_a_share_of_activations(kind):
    """Sizes [400, 200, 100, 200] cut in 2 contiguous stages: the best cut is
    [400] | [200, 100, 200] (largest 500; [400, 200] | [100, 200] has 600). Each device
    holds 16 B per parameter of its stage, half of the 1000 activation bytes and the
    update's temporaries of its own largest variable (400, then 200)."""
    estimate = estimate_memory([400, 200, 100, 200], MemoryConfig(kind, 2, activation_bytes=1000))
    assert [d.update for d in estimate.devices] == [12 * 400, 12 * 200]
    assert [d.total for d in estimate.devices] == [16 * 400 + 500 + 12 * 400,
                                                   16 * 500 + 500 + 12 * 200]
    assert [d.gradients for d in estimate.devices] == [4 * 400, 4 * 500]


def test_more_stages_than_variables_is_refused():
    with pytest.raises(ValueError, match="Cannot place 2 layers on 3 devices"):
        estimate_memory([10, 10], MemoryConfig("pipeline", 3))


def test_a_built_keras_model_is_read_by_its_variables():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])  # 12 + 3 params
    # No optimizer compiled: Adam's 2 slots; the update's temporaries are the kernel's.
    assert estimate_memory(model, _config(None, 2)).peak == 16 * 15 + 4 * 3 * 12


def test_format_has_a_row_per_device():
    text = estimate_memory([1000] * 8, _config("gradients", 4)).format()
    assert "DataParallelStrategy(shard='gradients')" in text
    # 4 + 12/4 = 7, and the update's 4 * 3 * 1000 bytes over 8000 parameters, 1.5.
    assert "8,000 parameters" in text and "8.50 B/param" in text
    assert "update" in text.splitlines()[1]  # The column header.
    assert len([line for line in text.splitlines() if line[:1].isdigit()]) == 4


# --- Bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="zero"), "kind must be one of"),
    (dict(num_devices=0), "num_devices must be a whole number >= 1. Received: num_devices=0"),
    (dict(num_devices=2.5), "num_devices must be a whole number"),
    (dict(activation_bytes=-1), "activation_bytes must be a whole number >= 0"),
    (dict(dtype_bytes=0), "dtype_bytes must be a whole number >= 1"),
    (dict(shard="weights"), "shard must be None"),
    (dict(kind="model", shard="optimizer"), "kind='model' is one copy of the model"),
    (dict(num_replicas=2), "num_replicas counts the copies of a pipeline"),
    (dict(kind="sharded"), "kind='sharded' needs shard="),
])
def test_bad_configs_say_what_to_fix(kwargs, match):
    args = dict(kind="data", num_devices=4) | kwargs
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        MemoryConfig(**args)


@pytest.mark.parametrize("spec,kwargs,error,match", [
    (-5, {}, ValueError, "num_params must be a whole number >= 1. Received: num_params=-5"),
    (0, {}, ValueError, "num_params must be a whole number >= 1"),
    ("1e9", {}, TypeError, "Describe the model by its number of parameters"),
    ([], {}, ValueError, "at least one parameter"),
    ([10, -1], {}, ValueError, r"sizes\[1\] must be a whole number >= 0"),
    ([10, 20], dict(largest_variable=20), ValueError, "Drop it"),
    (100, dict(largest_variable=101), ValueError, "cannot exceed"),
])
def test_bad_models_say_what_to_fix(spec, kwargs, error, match):
    with pytest.raises(error, match=match):
        estimate_memory(spec, _config(None, 2), **kwargs)


def test_a_strategy_or_config_is_required():
    with pytest.raises(TypeError, match="Pass a tfpar strategy or a MemoryConfig"):
        estimate_memory(100, "data")


@pytest.mark.parametrize("args,match", [
    ((1000, 0, 10_000), "num_devices must be a whole number >= 1"),
    ((1000, 4, 0), "bytes_per_device must be a whole number >= 1"),
    ((-1, 4, 10_000), "num_params must be a whole number >= 1"),
])
def test_bad_advice_requests_say_what_to_fix(args, match):
    with pytest.raises(ValueError, match=match):
        advise(*args)


# --- The advisor ---------------------------------------------------------------------

# P=1000 (a total), N=4, Adam fp32, no activations; owned = 250 each:
#   data 16*1000 = 16000; stage 1 8000 + 8*250 = 10000; stage 2 4000 + 12*250 = 7000;
#   stage 3 16*250 = 4000 (largest unknown: no gather buffer); pipeline K=2: 16*500 = 8000.
# With 10000 activation bytes per model copy, ZeRO adds them whole: stage 3 = 14000; a
# pipeline splits them: K=2: (16000 + 10000)/2 = 13000, K=4: (16000 + 10000)/4 = 6500.
DATA, STAGE = "DataParallelStrategy()", "DataParallelStrategy(shard={!r})"


@pytest.mark.parametrize("activations,budget,strategy,stage,degree", [
    (0, 16000, DATA, 0, 4),
    (0, 15999, STAGE.format("optimizer"), 1, 4),
    (0, 10000, STAGE.format("optimizer"), 1, 4),
    (0, 9999, STAGE.format("gradients"), 2, 4),
    (0, 7000, STAGE.format("gradients"), 2, 4),
    (0, 6999, STAGE.format("parameters"), 3, 4),
    (0, 4000, STAGE.format("parameters"), 3, 4),
    (0, 3999, None, None, None),
    (10000, 14000, STAGE.format("parameters"), 3, 4),
    (10000, 13999, "PipelineStrategy(num_stages=2, num_replicas=2)", None, 2),
    (10000, 13000, "PipelineStrategy(num_stages=2, num_replicas=2)", None, 2),
    # K=2 with ZeRO-1 over its 2 replicas: 4*500 + 4*500 + 8*250 + 5000 = 11000 fits, and
    # beats K=4 (a smaller bubble, the same traffic as the all-reduce).
    (10000, 12999, "PipelineStrategy(num_stages=2, num_replicas=2, shard='optimizer')", None, 2),
    # K=2, ZeRO-2: 4*500 + 4*250 + 8*250 + 5000 = 10000.
    (10000, 10000, "PipelineStrategy(num_stages=2, num_replicas=2, shard='gradients')", None, 2),
    (10000, 9999, "PipelineStrategy(num_stages=4, num_replicas=1)", None, 4),
    (10000, 6500, "PipelineStrategy(num_stages=4, num_replicas=1)", None, 4),
    (10000, 6499, None, None, None),
])
def test_the_least_sharding_that_fits_is_chosen(activations, budget, strategy, stage, degree):
    advice = advise(1000, 4, budget, activation_bytes=activations)
    assert (advice.strategy, advice.stage, advice.degree) == (strategy, stage, degree)


def test_every_option_reports_its_bytes_per_device():
    advice = advise(1000, 4, 15999)
    assert [o.name for o in advice.options] == [
        "data parallel", "ZeRO stage 1", "ZeRO stage 2", "ZeRO stage 3", "pipeline, 2 stages"]
    assert [o.bytes_per_device for o in advice.options] == [16000, 10000, 7000, 4000, 8000]
    assert [o.fits for o in advice.options] == [False, True, True, True, True]


def test_pipeline_stages_divide_the_devices():
    """P=1000 over 6 devices, 6000 activation bytes. ZeRO stage 3: owned 167, so
    16*167 + 6000 = 8672. Pipelines: K=2 (R=3) with ZeRO-2: 4*500 + 12*167 + 3000 = 7004;
    K=3 holds ceil(1000/3)=334 -> 5344 + 2000 = 7344, with ZeRO-1 over its 2 replicas
    8*334 + 8*167 + 2000 = 6008 (chosen); K=4 would need 4000 + 1500 = 5500 but does not
    divide 6; K=6: 2672 + 1000 = 3672 (the single pipeline option: the fewest stages
    without ZeRO that fit)."""
    advice = advise(1000, 6, 7000, activation_bytes=6000)
    assert advice.strategy == "PipelineStrategy(num_stages=3, num_replicas=2, shard='optimizer')"
    assert (advice.data, advice.pipe, advice.model, advice.zero) == (2, 3, 1, 1)
    assert advice.chosen.bytes_per_device == 6008
    assert advice.options[-1].strategy == "PipelineStrategy(num_stages=6, num_replicas=1)"
    assert advice.options[-1].bytes_per_device == 16 * 167 + 1000


def test_variable_sizes_give_exact_owners_and_cuts():
    """[1000, 10, 10, 10] on 2 devices: stage 3's peak is the huge variable's owner,
    16*1000 + 4*1000 + its update 12*1000 = 32000; a 2-stage pipeline cuts
    [1000] | [10, 10, 10]: 16000 + 12000 = 28000. At 28000 data parallelism (16*1030 +
    12000 = 28480), ZeRO-1 (8*1030 + 8*1000 + 12000 = 28240) and ZeRO-2 (4*1030 +
    12*1000 + 12000 = 28120) are just over: the pipeline is chosen."""
    advice = advise([1000, 10, 10, 10], 2, 28000)
    assert [o.bytes_per_device for o in advice.options] == [28480, 28240, 28120, 32000, 28000]
    assert advice.strategy == "PipelineStrategy(num_stages=2, num_replicas=1)"


def test_one_device_has_no_pipeline_and_says_so():
    advice = advise(1000, 1, 100)
    assert advice.strategy is None and len(advice.options) == 4
    assert "No pipeline" in advice.explain()


def test_explain_lists_every_option_against_the_budget():
    text = advise(1000, 4, 9999).explain()
    lines = text.splitlines()
    chosen = [line for line in lines if "<- chosen" in line]
    assert len(chosen) == 1 and "shard='gradients'" in chosen[0]
    assert "over by 1 B" in text  # Stage 1 needs 10000 against 9999.
    assert "stage 1 needs 9.8 KiB" in text
    assert "largest variable is unknown" in text


def test_explain_when_nothing_fits_says_how_many_devices_would():
    """Stage 3 holds 16000/N bytes: under 3999 it needs N >= 16000/3999 = 4.001, so 5."""
    text = advise(1000, 4, 3999).explain()
    assert "Does not fit" in text and "about 5 devices" in text
    assert advise(1000, 5, 3999).stage == 3


def test_explain_names_activations_when_a_pipeline_is_chosen():
    text = advise(1000, 4, 13000, activation_bytes=10000).explain()
    assert "9.8 KiB are activations, which ZeRO does not shard" in text


# --- Units ---------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("16GiB", 16 * 2**30), ("80GB", 80 * 10**9), ("1.5e9", 1_500_000_000),
    ("512 mib", 512 * 2**20), ("1.5KiB", 1536), ("0", 0), ("-1KB", -1000),
])
def test_parse_bytes(text, expected):
    assert units.parse_bytes(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("1.3e9", 1_300_000_000), ("1.3B", 1_300_000_000), ("350M", 350_000_000), ("8", 8),
])
def test_parse_count(text, expected):
    assert units.parse_count(text) == expected


@pytest.mark.parametrize("text,match", [
    ("16 GiBs", "Cannot read '16 GiBs' as bytes"), ("", "Cannot read"), ("nan", "Cannot read"),
    ("1.5B", "must come to a whole number of bytes"),
])
def test_unreadable_bytes_say_how_to_write_them(text, match):
    with pytest.raises(ValueError, match=match):
        units.parse_bytes(text)


# --- Command line --------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tfpar.plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_advises_the_13b_example_without_tensorflow():
    """1.3e9 Adam fp32 params: a replica needs 20.8e9 B > 16 GiB (17.18e9); ZeRO stage 1
    needs 9 B/param on 8 devices, 11.7e9 B."""
    result = _cli("advise", "--params", "1.3e9", "--devices", "8",
                  "--bytes_per_device", "16GiB")
    assert result.returncode == 0, result.stderr
    chosen = [line for line in result.stdout.splitlines() if "<- chosen" in line]
    assert chosen and "shard='optimizer'" in chosen[0]
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, tfpar.plan.__main__; "
                               "print(sorted({'tensorflow', 'keras'} & set(sys.modules)))"],
        capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr


@pytest.mark.parametrize("budget,shard", [("10000", "optimizer"), ("9999", "gradients")])
def test_cli_boundary(budget, shard):
    result = _cli("advise", "--params", "1000", "--devices", "4", "--bytes_per_device", budget)
    chosen = [line for line in result.stdout.splitlines() if "<- chosen" in line]
    assert chosen and f"shard={shard!r}" in chosen[0]


def test_cli_takes_sizes_and_other_optimizers():
    # SGD keeps no state: a replica of [1000, 10, 10, 10] needs 8 * 1030 = 8240.
    result = _cli("advise", "--sizes", "1000,10,10,10", "--devices", "2",
                  "--bytes_per_device", "8240", "--optimizer", "sgd")
    assert "DataParallelStrategy()" in [line for line in result.stdout.splitlines()
                                        if "<- chosen" in line][0]


def test_cli_estimate_prints_the_table():
    result = _cli("estimate", "--sizes", "1000,1000", "--devices", "2", "--kind", "sharded",
                  "--shard", "parameters")
    assert result.returncode == 0, result.stderr
    assert "DataParallelStrategy(shard='parameters')" in result.stdout
    # 16 * 1000 + 4 * 1000 gathered + 4 * 3 * 1000 updated = 32000 B per device
    # (31.25 KiB, printed to one decimal, half to even), 16 B/param of 2000.
    assert "31.2 KiB" in result.stdout and "16.00 B/param" in result.stdout


def test_cli_estimates_a_pipeline_with_zero_over_its_replicas():
    result = _cli("estimate", "--sizes", "100,100,100,100", "--devices", "2", "--kind",
                  "pipeline", "--replicas", "2", "--shard", "optimizer")
    assert result.returncode == 0, result.stderr
    assert "PipelineStrategy(num_stages=2, num_replicas=2, shard='optimizer')" in result.stdout
    # Each of the 4 devices: its stage's 200 weights and gradients, Adam's state of its 100
    # (2400 B) and the update of its largest owned variable, 4 * 3 * 100: 3600 B = 3.5 KiB.
    rows = [line.split() for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert all(row[-4:] == ["1.2", "KiB", "3.5", "KiB"] for row in rows), rows


@pytest.mark.parametrize("args,message", [
    (["--params", "-5"], "argument --params: must be at least 1. Received: '-5'"),
    (["--devices", "0"], "argument --devices: must be at least 1. Received: '0'"),
    (["--bytes_per_device", "16GB2"], "argument --bytes_per_device: Cannot read '16GB2'"),
    (["--optimizer", "adamz"], "Here: give --optimizer_slots"),
    (["--sizes", "10,x"], "argument --sizes: Cannot read 'x'"),
])
def test_cli_bad_input_exits_2_and_names_the_flag(args, message):
    flags = {"--params": "1e9", "--devices": "8", "--bytes_per_device": "16GiB"}
    if "--sizes" in args:
        del flags["--params"]
    flags.update(zip(args[::2], args[1::2]))
    result = _cli("advise", *[item for pair in flags.items() for item in pair])
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


def test_cli_errors_from_the_planner_exit_2():
    result = _cli("estimate", "--params", "1e9", "--devices", "4", "--kind", "sharded")
    assert result.returncode == 2 and "needs shard=" in result.stderr


def test_cli_main_returns_0_in_process(capsys):
    assert cli.main(["advise", "--params", "1000", "--devices", "4",
                     "--bytes_per_device", "16000"]) == 0
    assert "DataParallelStrategy()  " in capsys.readouterr().out


# --- Examples in docstrings ----------------------------------------------------------

@pytest.mark.parametrize("module", [memory, units, advisor, communication])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted and not result.failed


def test_paced_gradients_hold_a_window_not_the_stage_share():
    """Stages 1-2 across workers send each gradient as it is made: a replica holds the
    window in flight and two of the largest variable's gradients, never more than the
    stage's share; stage 0 and stage 3 ignore the window."""
    sizes = [1000] * 8  # 4 B each: 32 KB of gradients, 8 KB per variable.
    window = 4000
    for shard, share in (("optimizer", 8000), ("gradients", 4000)):
        paced = estimate_memory(sizes, MemoryConfig("sharded", 2, shard, optimizer_slots=0,
                                                    gradient_window_bytes=window))
        whole = estimate_memory(sizes, MemoryConfig("sharded", 2, shard, optimizer_slots=0))
        assert whole.devices[0].gradients == 4 * share
        assert paced.devices[0].gradients == window + 2 * 4 * 1000
        assert paced.devices[0].weights == whole.devices[0].weights
    tiny = estimate_memory([10] * 8, MemoryConfig("sharded", 2, "gradients",
                                                  gradient_window_bytes=10**6))
    assert tiny.devices[0].gradients == 4 * 40  # Capped at the stage's share.
    for kind, shard in (("data", None), ("sharded", "parameters")):
        windowed = MemoryConfig(kind, 2, shard, gradient_window_bytes=4)
        assert (estimate_memory(sizes, windowed).devices
                == estimate_memory(sizes, MemoryConfig(kind, 2, shard)).devices)


@pytest.mark.parametrize("shard, per_param", [
    (None, 16), ("optimizer", 8 + 8 / 2), ("gradients", 4 + 12 / 2), ("parameters", 16 / 2)])
def test_a_pipeline_shards_each_stage_over_its_replicas(shard, per_param):
    """K=2 stages x R=2 replicas: each stage's 4 equal variables, two per owner; devices in
    the order of PipelineStrategy.stage_devices (replica r's stage s at r * K + s)."""
    config = MemoryConfig("pipeline", 2, shard=shard, num_replicas=2,
                          reshard_after_forward=False)
    estimate = estimate_memory([100] * 8, config)
    assert len(estimate.devices) == 4
    for device in estimate.devices:
        assert (device.weights + device.gradients + device.optimizer) / 400 == per_param
        assert device.gather_buffer == (200 * 4 if shard == "parameters" else 0)
    assert config.strategy() == ("PipelineStrategy(num_stages=2, num_replicas=2"
                                 + (f", shard={shard!r})" if shard else ")"))


def test_input_batches_sit_on_every_replica_and_on_a_pipelines_first_stage_only():
    data = estimate_memory([100] * 4, MemoryConfig("data", 2, input_bytes=1000))
    assert [d.inputs for d in data.devices] == [4000, 4000]  # In use, arriving, 2 prefetched.
    pipe = estimate_memory([100] * 4, MemoryConfig("pipeline", 2, num_replicas=2,
                                                   input_bytes=1000, input_copies=3))
    assert [d.inputs for d in pipe.devices] == [3000, 0, 3000, 0]
    assert estimate_memory([100] * 4, MemoryConfig("pipeline", 2, input_bytes=1000)).devices[
        0].inputs == 4000
    assert (pipe.devices[0].total - pipe.devices[1].total) == 3000
    assert "inputs" in pipe.format()
    with pytest.raises(ValueError, match="input_copies"):
        MemoryConfig("data", 2, input_copies=-1)
