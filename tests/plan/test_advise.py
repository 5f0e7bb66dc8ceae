"""The advisor picks data x pipe x model degrees (and a ZeRO stage); communication per step;
the mapping from an advice to the strategy `--strategy=auto` builds. Pure Python.

Numbers are worked out by hand with Adam in float32: 16 bytes per parameter of weights (4),
gradients (4) and optimizer state (8), and the update's temporaries, 12 bytes per value of
the largest variable (here layer) a device updates (3 copies of it). tfpar's ZeRO shards
whole variables (here whole layers): a layer's state always sits whole on its owner, who
also updates it, so the largest layer's 16 + 12 bytes per parameter bound every layout
without tensor parallelism.
"""

import subprocess
import sys

import pytest

from tfpar.cli import factory
from tfpar.plan import advise, estimate_memory
from tfpar.plan.advisor import Traffic
from tfpar.plan.communication import (data_parallel_bytes, pipeline_bytes,
                                      tensor_parallel_bytes)
from tfpar.plan.memory import MemoryConfig
from tfpar.plan.placement import LayerCost


def layers(*params_and_activations):
    return [LayerCost(f"l{i}", p, 0, 0, a) for i, (p, a) in enumerate(params_and_activations)]


def degrees(advice):
    return advice.data, advice.pipe, advice.model, advice.zero


def assert_chosen_fits_and_simpler_do_not(model, advice):
    """The choice's own estimate fits; every layout before it in the order does not."""
    chosen = advice.chosen
    assert estimate_memory(model, chosen.config).peak <= advice.budget
    before = advice.candidates[:advice.candidates.index(chosen)]
    for option in before:
        assert estimate_memory(model, option.config).peak > advice.budget, option.name
    return before


# --- Situations where the right answer differs -------------------------------------------

FOUR = layers(*[(1000, 0)] * 4)  # 4000 params: 64000 B for a full copy, + 12000 to update.


def test_a_small_model_is_data_parallel():
    advice = advise(FOUR, 4, 100_000)
    assert degrees(advice) == (4, 1, 1, 0)
    assert advice.strategy == "DataParallelStrategy()"
    assert advice.chosen.bytes_per_device == 64000 + 12 * 1000
    assert assert_chosen_fits_and_simpler_do_not(FOUR, advice) == ()
    # One all-reduce of 16000 gradient bytes over 4: 2 * 3/4 * 16000.
    assert advice.chosen.traffic == Traffic(24000, 0, 0)


# Each of 4 replicas owns one layer under ZeRO and updates it: 12 * 1000 on every layout.
# Data parallel 76000, ZeRO-1 52000, ZeRO-2 40000.
@pytest.mark.parametrize("budget,zero,peak", [
    # weights and gradients whole, a quarter of Adam
    (60_000, 1, 8 * 4000 + 8 * 1000 + 12 * 1000),
    (45_000, 2, 4 * 4000 + 12 * 1000 + 12 * 1000),  # also a quarter of the gradients
])
def test_optimizer_state_too_big_takes_zero_1_or_2(budget, zero, peak):
    advice = advise(FOUR, 4, budget)
    assert degrees(advice) == (4, 1, 1, zero)
    assert advice.chosen.bytes_per_device == peak
    before = assert_chosen_fits_and_simpler_do_not(FOUR, advice)
    assert [o.name for o in before] == ["data parallel", "ZeRO stage 1"][:zero]
    assert advice.chosen.traffic.data == 24000  # ZeRO-1/2: the all-reduce's volume.


EIGHT = layers(*[(1000, 0)] * 8)  # 8000 params, 128000 B for a full copy, + 12000 to update.


def test_too_big_for_one_device_on_one_host_takes_zero_3():
    """Budget 50000 on 4 devices (each updating one 1000-parameter layer at a time: 12000
    on every layout): ZeRO-2 needs 4*8000 + 12*2000 + 12000 = 68000; ZeRO-3 holds 16*2000,
    gathers one 1000-parameter layer at a time and updates one: 32000 + 4000 + 12000 =
    48000."""
    advice = advise(EIGHT, 4, 50_000)
    assert degrees(advice) == (4, 1, 1, 3)
    assert advice.chosen.bytes_per_device == 48000
    assert_chosen_fits_and_simpler_do_not(EIGHT, advice)
    assert advice.chosen.traffic.data == 1.5 * 2 * 3 / 4 * 4 * 8000


def test_across_hosts_the_pipeline_comes_before_zero_3():
    """The same model, devices and budget on 2 hosts: pipelines (one activation per
    micro-batch over the hosts' link) come before ZeRO-3 (every weight gathered across it).
    With each layout's 12000 of update: K=2 over R=2 needs 64000 + 12000 = 76000, with
    ZeRO-1 60000, ZeRO-2 52000; K=4 holds 2000 params: 32000 + 12000 = 44000."""
    advice = advise(EIGHT, 4, 50_000, hosts=2)
    assert degrees(advice) == (1, 4, 1, 0)
    assert advice.strategy == "PipelineStrategy(num_stages=4, num_replicas=1)"
    before = assert_chosen_fits_and_simpler_do_not(EIGHT, advice)
    assert [o.bytes_per_device for o in before] == [
        128000 + 12000, 80000 + 12000, 56000 + 12000, 64000 + 12000, 48000 + 12000,
        40000 + 12000]
    assert "ZeRO stage 3" not in [o.name for o in before]


def test_activations_zero_does_not_shard_take_a_pipeline_on_one_host():
    """8 layers keeping 5000 activation bytes each (40000 per model copy), budget 85000 on
    4 devices, every layout updating one 1000-parameter layer at a time (12000): ZeRO-3 =
    48000 + 40000 = 88000; a 2-stage pipeline holds 4 layers' state and activations
    (64000 + 12000 + 20000 = 96000 without ZeRO), with ZeRO-1 over its 2 replicas:
    16000 + 16000 + 8 * 2000 + 12000 + 20000 = 80000."""
    model = layers(*[(1000, 5000)] * 8)
    advice = advise(model, 4, 85_000)
    assert degrees(advice) == (2, 2, 1, 1)
    assert advice.chosen.bytes_per_device == 80000
    before = assert_chosen_fits_and_simpler_do_not(model, advice)
    assert before[3].name == "ZeRO stage 3" and before[3].bytes_per_device == 88000
    assert "are activations, which ZeRO does not shard" in advice.explain()


# Two layers of 1000 parameters, each keeping 6000 activation bytes: one layer's state and
# update alone are 16000 + 12000 = 28000 B, over a budget of 24000, so nothing without
# tensor parallelism fits.
TWO_WIDE = layers((1000, 6000), (1000, 6000))


def test_one_layer_bigger_than_a_device_takes_tensor_x_pipeline():
    """8 devices, one host, 24000 B. T=2 without a pipeline keeps both layers' activations
    (12000) beside its half-layers: with ZeRO-2 over R=4, 4*1000 weights + a half-layer's
    gradients and Adam state on its owner (12*500) + its update (12*500) = 16000 + 12000;
    T=2 x K=2 over R=2 holds one half-layer (8000), its update (6000) and its activations
    (6000): 20000."""
    advice = advise(TWO_WIDE, 8, 24_000)
    assert degrees(advice) == (2, 2, 2, 0)
    assert advice.strategy == "PipelineStrategy(num_stages=2, num_replicas=2, tensor_parallel=2)"
    assert advice.chosen.bytes_per_device == 20000
    before = assert_chosen_fits_and_simpler_do_not(TWO_WIDE, advice)
    # Every layout without tensor parallelism was tried first, then T=2 without a pipeline.
    assert [o.model for o in before] == [1] * (len(before) - 3) + [2] * 3
    assert [(o.pipe, o.zero) for o in before[-3:]] == [(1, 0), (1, 1), (1, 2)]
    assert advice.largest_layer_bytes == 16000 + 12000
    text = advice.explain()
    assert "over the budget: no pipeline stage can hold it" in text
    assert "Degrees: data=2 pipe=2 model=2 zero=0" in text
    # Traffic of the busiest device: gradients of 500 params over 2 replicas (2000 B), one
    # 6000 B activation one way between 2 stages, and one layer pair's 2 all-reduces of
    # 6000 B over T=2 (2 * 2 * 1/2 * 6000).
    assert advice.chosen.traffic == Traffic(2000, 6000, 12000)


def test_tensor_parallelism_stays_within_a_host():
    """Budget 17000: T=2 x K=2 needs 20000 (ZeRO over its 2 replicas cannot split a
    half-layer: its owner keeps and updates it whole); T=4 x K=2 holds a quarter layer
    (4000), its update (3000) and one layer's activations: 13000. On hosts of 4 devices
    T=4 is allowed; on hosts of 2 it is not, and nothing fits: the smallest shortfall is
    T=2 x K=2's 3000 B."""
    one_host = advise(TWO_WIDE, 8, 17_000)
    assert degrees(one_host) == (1, 2, 4, 0)
    assert one_host.chosen.bytes_per_device == 13000
    assert_chosen_fits_and_simpler_do_not(TWO_WIDE, one_host)
    assert degrees(advise(TWO_WIDE, 8, 17_000, hosts=2)) == (1, 2, 4, 0)
    four_hosts = advise(TWO_WIDE, 8, 17_000, hosts=4)
    assert four_hosts.chosen is None and degrees(four_hosts) == (None,) * 4
    assert max(o.model for o in four_hosts.candidates) == 2
    assert four_hosts.shortfall == 3000
    assert (four_hosts.closest.model, four_hosts.closest.pipe) == (2, 2)
    text = four_hosts.explain()
    assert "Does not fit" in text and "over by 2.9 KiB" in text
    assert "T divides the 2 devices per host" in text
    assert "Degrees: none fits" in text


def test_the_choice_always_fits_its_own_estimate():
    """A sweep of models, devices, hosts and budgets: whatever is chosen fits
    estimate_memory of its config, and everything tried before it does not."""
    models = [FOUR, EIGHT, TWO_WIDE, layers((5000, 100), (10, 9000), (3000, 10), (700, 700)),
              [4000, 10, 10, 4000, 10, 10, 2000]]
    for model in models:
        for num_devices, hosts in ((1, 1), (2, 1), (4, 1), (4, 2), (8, 2), (6, 3)):
            for budget in (5_000, 9_000, 14_000, 20_000, 40_000, 70_000, 150_000):
                advice = advise(model, num_devices, budget, activation_bytes=2000, hosts=hosts)
                if advice.chosen is None:
                    assert all(not o.fits for o in advice.candidates)
                    assert advice.shortfall == min(o.bytes_per_device
                                                   for o in advice.candidates) - budget > 0
                else:
                    assert_chosen_fits_and_simpler_do_not(model, advice)
                    assert advice.data * advice.pipe * advice.model == num_devices
                    assert (num_devices // hosts) % advice.model == 0


# --- Communication per step (hand-computed) ----------------------------------------------

def test_communication_formulas():
    assert data_parallel_bytes(1000, 4) == 1500  # 2 (N-1)/N
    assert data_parallel_bytes(1000, 4, zero_stage=2) == 1500  # reduce-scatter + all-gather
    assert data_parallel_bytes(1000, 4, zero_stage=3) == 2250  # 1.5x
    assert data_parallel_bytes(1000, 1) == 0
    assert pipeline_bytes(100, 1, 8) == 0
    assert pipeline_bytes(100, 2, 8) == 800  # 8 micro-batches, one way
    assert pipeline_bytes(100, 4, 8) == 1600  # a middle stage: forward and backward
    assert tensor_parallel_bytes(1000, 2, num_layer_pairs=3, num_micro_batches=4) == 24000
    assert tensor_parallel_bytes(1000, 4, num_layer_pairs=1) == 2 * 1.5 * 1000
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        data_parallel_bytes(1000, 4, zero_stage=4)


def test_traffic_with_a_total_only_is_unknown_beyond_the_data_axis():
    advice = advise(1000, 4, 3999)  # Nothing fits; every layout still has its traffic.
    pipelines = [o for o in advice.candidates if o.pipe > 1]
    assert all(o.traffic.pipe is None for o in pipelines)
    assert "+?" in advice.explain() and "traffic are unknown" in advice.explain()
    given = advise(1000, 4, 3999, layer_output_bytes=100)
    k4 = next(o for o in given.candidates if (o.pipe, o.model) == (4, 1))
    assert k4.traffic == Traffic(0, 200, 0)


# --- The memory estimate under tensor parallelism -----------------------------------------

def test_tensor_parallel_estimate_splits_each_variable_and_orders_devices():
    """K=2 x T=2 x R=2 of [1000, 1000, 10]: stage 0 holds [1000] -> 500 per device; stage 1
    [1000, 10] -> 505. Device (r, s, t) at (r * K + s) * T + t."""
    config = MemoryConfig("pipeline", 2, num_replicas=2, tensor_parallel=2)
    estimate = estimate_memory([1000, 1000, 10], config)
    assert len(estimate.devices) == 8
    weights = [d.weights for d in estimate.devices]
    assert weights == [2000, 2000, 2020, 2020] * 2
    assert config.strategy() == "PipelineStrategy(num_stages=2, num_replicas=2, tensor_parallel=2)"


# --- Bad input: clear and fast ------------------------------------------------------------

@pytest.mark.parametrize("args,kwargs,error,match", [
    ((FOUR, 4, 10_000), dict(hosts=0), ValueError, "hosts must be a whole number >= 1"),
    ((FOUR, 6, 10_000), dict(hosts=4), ValueError, "do not spread evenly over 4 hosts"),
    ((FOUR, 4, 10_000), dict(layer_output_bytes=-1), ValueError, "layer_output_bytes"),
    ((FOUR + [10], 4, 10_000), {}, TypeError, "not a mix"),
    ((layers((10, -5)), 4, 10_000), {}, ValueError, r"layers\[0\].activation_bytes"),
    ((FOUR, 4, 0), {}, ValueError, "bytes_per_device must be a whole number >= 1"),
])
def test_bad_requests_say_what_to_fix(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        advise(*args, **kwargs)


def test_tensor_parallel_needs_a_pipeline_config():
    with pytest.raises(ValueError, match="use kind='pipeline'"):
        MemoryConfig("sharded", 4, "optimizer", tensor_parallel=2)


# --- From the advice to the strategy (--strategy=auto) ------------------------------------

@pytest.mark.parametrize("model,devices,budget,hosts,expected", [
    (FOUR, 4, 100_000, 1, ("data", {"shard": None})),
    (FOUR, 4, 60_000, 1, ("data", {"shard": "optimizer"})),
    (FOUR, 4, 45_000, 1, ("data", {"shard": "gradients"})),
    (EIGHT, 4, 50_000, 1, ("data", {"shard": "parameters"})),
    (EIGHT, 4, 50_000, 2, ("pipeline", {"num_stages": 4, "num_replicas": 1, "shard": None})),
    (layers(*[(1000, 5000)] * 8), 4, 85_000, 1,
     ("pipeline", {"num_stages": 2, "num_replicas": 2, "shard": "optimizer"})),
    (TWO_WIDE, 8, 24_000, 1, ("pipeline", {"num_stages": 2, "num_replicas": 2, "shard": None,
                                           "tensor_parallel": 2})),
])
def test_from_advice_names_each_kind(model, devices, budget, hosts, expected):
    advice = advise(model, devices, budget, hosts=hosts)
    assert factory.from_advice(advice) == expected


def test_auto_refuses_when_nothing_fits():
    with pytest.raises(factory.AutoError, match="no layout fits.*smallest shortfall"):
        factory.from_advice(advise(TWO_WIDE, 8, 17_000, hosts=4))


# --- Command line -------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tfpar.plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_advises_degrees_from_layers_and_hosts():
    result = _cli("advise", "--layers", "1000:6000,1000:6000", "--devices", "8",
                  "--bytes_per_device", "24000")
    assert result.returncode == 0, result.stderr
    assert "Degrees: data=2 pipe=2 model=2 zero=0" in result.stdout
    result = _cli("advise", "--layers", "1000:6000,1000:6000", "--devices", "8", "--hosts",
                  "4", "--bytes_per_device", "17000")
    assert result.returncode == 0, result.stderr
    assert "Does not fit" in result.stdout and "Degrees: none fits" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["--hosts", "3"], "do not spread evenly over 3 hosts"),
    (["--hosts", "0"], "argument --hosts: must be at least 1"),
    (["--layer_output_bytes", "x"], "argument --layer_output_bytes: Cannot read 'x'"),
])
def test_cli_bad_hosts_exit_2(args, message):
    result = _cli("advise", "--layers", "1000:6000,1000:6000", "--devices", "8",
                  "--bytes_per_device", "15000", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_cli_estimates_tensor_parallel():
    result = _cli("estimate", "--sizes", "1000,1000", "--devices", "2", "--kind", "pipeline",
                  "--tensor_parallel", "2")
    assert result.returncode == 0, result.stderr
    assert "tensor_parallel=2" in result.stdout
