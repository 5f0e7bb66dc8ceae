"""tfpar: parallel and distributed training of Keras 3 models on TensorFlow 2.

Importing tfpar does not import TensorFlow: names are resolved on first use, so
`tfpar.virtual_cpus(n)` still works after `import tfpar`.

    import tfpar
    tfpar.virtual_cpus(2)
    strategy = tfpar.DataParallelStrategy()
"""

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (attribute of the same name), or the
# module itself for public submodules.
_EXPORTS = {
    "virtual_cpus": "tfpar.devices",
    "DataParallelStrategy": "tfpar.distribute.data_parallel.data_parallel_strategy",
    "ModelParallelStrategy": "tfpar.distribute.model_parallel.model_parallel_strategy",
    "PipelineStrategy": "tfpar.distribute.pipeline.pipeline_strategy",
    "layers": "tfpar.layers",
    "ParameterServerStrategy": "tfpar.distribute.parameter_server.parameter_server_strategy",
    "collectives": "tfpar.distribute.common.collectives",
    "data": "tfpar.data",
    "errors": "tfpar.errors",
    "plan": "tfpar.plan",
    "MeshStrategy": "tfpar.distribute.mesh.mesh_strategy",
    "use_keras_distribution": "tfpar.distribute.mesh.mesh_strategy",
    "ProcessMemory": "tfpar.cluster.memory_probe",
    "process_memory": "tfpar.cluster.memory_probe",
    "reset_memory_peaks": "tfpar.cluster.memory_probe",
    "use_allocator_statistics": "tfpar.cluster.memory_probe",
    "MemoryPeaks": "tfpar.keras.memory_peaks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tfpar' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.rsplit(".", 1)[-1] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
