"""The choices of the distributed layer's config keys, without torch: the config reads them before
torch is imported (a typo is answered at once); the modules that implement them import them from
here.

Legend: none (no tensors here).
"""

DEVICES = ("auto", "cpu", "cuda")
# The package's one dtype table, by name: config name -> the tools' short name (utils.py maps
# both to torch dtypes). training.mixed_precision_* take the long names, the tools' --dtype the
# short ones.
DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32"}
# The knobs every parallelize function honours: compile.backend, parallelism.fsdp_reshard_after_forward
# and parallelism.fsdp_sync (when FSDP reduces within a segment: after its last micro-batch, or each).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
RESHARD_AFTER_FORWARD = {"default": False, "never": False, "always": True}
FSDP_SYNC = ("segment", "micro_batch")
AC_MODES = ("none", "block", "loop", "segment")  # activation_checkpoint.py
LAYOUTS = ("degrees", "auto")  # parallelism.layout: estimate.py ranks the layouts for "auto"
