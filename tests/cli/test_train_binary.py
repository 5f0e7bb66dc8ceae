"""The absl training binary, run as users run it: in its own process."""

import os
import re
import subprocess
import sys

import pytest

from test_data import TinyDigits

pytestmark = [pytest.mark.slow, pytest.mark.one_process]


def _train(*flags, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tfpar.cli.train", "--verbose=2", *flags],
                            capture_output=True, text=True, timeout=timeout, env=env)
    return result.returncode, result.stdout + result.stderr


def _final(output):
    match = re.search(r"final: loss=([\d.]+) accuracy=([\d.]+) samples/s=(\d+) replicas=(\d+)",
                      output)
    assert match, output[-3000:]
    return float(match[1]), float(match[2]), int(match[3]), int(match[4])


def test_default_job_reaches_accuracy_and_says_what_it_runs():
    """The README's main job. One line names the strategy, devices (why CPUs) and data; on
    a host with no GPU, TensorFlow's CUDA probe lines (twice "Could not find cuda drivers",
    "failed call to cuInit") and its INFO lines from before absl's logging starts are gone."""
    from tfpar.cli import cuda_noise

    code, output = _train()
    assert code == 0, output[-3000:]
    loss, accuracy, samples_per_second, replicas = _final(output)
    assert replicas == 2
    assert accuracy >= 0.9
    assert samples_per_second > 0
    assert "Epoch 10/10" in output
    lines = [line for line in output.splitlines() if line.startswith("tfpar.cli.train: ")]
    why = ("logical CPUs \\(CPU:0, CPU:1\\); no GPU on this host \\(no NVIDIA driver\\)"
           if cuda_noise.gpu_absent() else "GPUs")
    assert len(lines) == 1 and re.fullmatch(
        f"tfpar.cli.train: DataParallelStrategy on 2 {why}; dataset spirals \\(6000 train / "
        f"\\d+ test examples\\), global batch 64, 10 epochs", lines[0]), output[-3000:]
    for noise in ("cuInit", "Could not find cuda drivers", "absl::InitializeLog", "I0000 "):
        assert noise not in output, output[-3000:]


def test_model_parallel_strategy_trains(tmp_path):
    code, output = _train("--strategy=model", "--epochs=3", f"--model_dir={tmp_path}")
    assert code == 0, output[-3000:]
    loss, accuracy, _, replicas = _final(output)
    assert replicas == 1 and accuracy >= 0.9
    # By default Adam's rate decays (cosine) to 0 over the run's steps: the saved optimizer,
    # at its saved iteration count (3 epochs of 94 steps), says so.
    import keras

    optimizer = keras.saving.load_model(tmp_path / "model.keras").optimizer
    assert int(optimizer.iterations.numpy()) == 3 * 94
    assert float(optimizer.learning_rate.numpy()) < 1e-7  # 0.01 at a constant rate


def test_auto_trains_the_layout_the_advisor_names():
    """At 560000 B per device the binary's MLP (25,347 parameters, Adam, batch 64) fits
    neither data parallelism nor ZeRO 1-3 on 2 devices (ZeRO-2, the smallest, plans
    584,460 B), but a 2-stage pipeline (538,112 B, of which 198,144 the update of its
    16,512-parameter layer)."""
    code, output = _train("--strategy=auto", "--bytes_per_device=560000", "--epochs=1")
    assert code == 0, output[-3000:]
    assert "Degrees: data=1 pipe=2 model=1 zero=0" in output
    assert "tfpar.cli.train: PipelineStrategy on 2 logical CPUs" in output
    assert _final(output)[3] == 1


def test_auto_trains_tensor_parallelism_when_only_it_fits():
    """At 450000 B per device only tensor parallelism over the 2 devices fits (388,640 B
    planned; the 2-stage pipeline 538,112 B): the binary splits its hidden layers
    Megatron's way (`train.megatron_layout_map`)."""
    code, output = _train("--strategy=auto", "--bytes_per_device=450000", "--epochs=1")
    assert code == 0, output[-3000:]
    assert "Degrees: data=1 pipe=1 model=2 zero=0" in output
    assert "tfpar.cli.train: PipelineStrategy on 2 logical CPUs" in output
    assert _final(output)[3] == 1


@pytest.mark.parametrize("budget,message", [
    ("100000", r"no layout fits.*smallest shortfall"),
    ("lots", r"--bytes_per_device: Cannot read 'lots'"),
])
def test_auto_refuses_what_it_cannot_build_before_training(budget, message):
    code, output = _train("--strategy=auto", f"--bytes_per_device={budget}", timeout=120)
    assert code == 2, output[-3000:]
    assert re.search(message, output), output[-3000:]
    assert "final:" not in output and "Epoch" not in output


def test_the_planned_layers_are_the_built_model():
    from tfpar import data
    from tfpar.cli import train

    source = data.load("spirals")
    planned = train.model_layers(source.input_shape, source.num_classes, 64)
    built = train.build_model(source)
    assert [layer.params for layer in planned] == [
        layer.count_params() for layer in built.layers if layer.weights]


def test_a_bad_learning_rate_decay_is_refused_before_anything_starts():
    from tfpar.cli import train

    with pytest.raises(ValueError, match="learning_rate_decay must be 'cosine' or 'none'"):
        train.run("data", learning_rate_decay="linear")


def test_rerun_resumes_from_model_dir(tmp_path):
    model_dir = str(tmp_path / "run")
    code, output = _train("--epochs=2", f"--model_dir={model_dir}", f"--log_dir={tmp_path}/logs")
    assert code == 0, output[-3000:]
    code, output = _train("--epochs=3", f"--model_dir={model_dir}")
    assert code == 0, output[-3000:]
    assert "Epoch 3/3" in output and "Epoch 1/3" not in output and "Epoch 2/3" not in output
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == [
        "epoch-001.weights.h5", "epoch-002.weights.h5", "epoch-003.weights.h5"]
    assert os.path.exists(os.path.join(model_dir, "model.keras"))
    assert any(p.name.startswith("events.out") for p in (tmp_path / "logs").rglob("*"))


def test_trains_on_a_tfds_dataset_from_data_dir(tmp_path):
    TinyDigits(data_dir=str(tmp_path)).download_and_prepare()
    code, output = _train("--dataset=tiny_digits", f"--data_dir={tmp_path}", "--epochs=1",
                          "--batch_size=8", "--num_devices=4")
    assert code == 0, output[-3000:]
    assert _final(output)[3] == 4


@pytest.mark.parametrize("flags,message", [
    (["--batch_size=1"], r"global batch size \(1\) is smaller than the number of replicas \(2\)"),
    (["--batch_size=5"], r"does not divide evenly over 2 replicas"),
    (["--strategy=bogus"], r"strategy"),
    (["--communication=nccl"], r"NCCL"),
])
def test_bad_flags_fail_fast_with_a_clear_message(flags, message):
    code, output = _train(*flags, timeout=120)
    assert code != 0
    assert re.search(message, output), output[-3000:]


def test_console_script_help():
    result = subprocess.run(["tfpar", "train", "--helpshort"], capture_output=True, text=True,
                            timeout=60)
    # absl's help flags exit with status 1 after printing.
    assert "--num_devices" in result.stdout and "--model_dir" in result.stdout


def test_example_binary_trains():
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data_parallel.py")
    result = subprocess.run([sys.executable, example, "--epochs=2"], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"replicas=2, communication='reduce_to_one'\): test loss=[\d.]+ "
                      r"accuracy=([\d.]+)", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match[1]) > 0.6


def test_only_the_cuda_probe_and_early_info_lines_are_noise():
    from tfpar.cli import cuda_noise

    patterns = cuda_noise.noise_patterns({"TF_CPP_MIN_LOG_LEVEL": "2"})
    probe = ("E0000 00:00:1795678184.808148   24266 cuda_platform.cc:52] failed call to "
             "cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)")
    info = ("I0000 00:00:1795678778.241064   14898 port.cc:153] oneDNN custom operations "
            "are on.")
    error = ("E0000 00:00:1795678184.808148   24266 collective_ops.cc:90] Collective "
             "failed: Deadline Exceeded")
    assert cuda_noise.is_noise(probe, patterns) == cuda_noise.gpu_absent()
    assert cuda_noise.is_noise(info, patterns)
    assert not cuda_noise.is_noise(error, patterns)
    assert not cuda_noise.is_noise("Traceback (most recent call last):", patterns)
    # INFO lines are TensorFlow's to show when its log level asks for them.
    assert not cuda_noise.is_noise(info, cuda_noise.noise_patterns({}))
