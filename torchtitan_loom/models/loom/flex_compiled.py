"""flex_attention compiled once per process, for CUDA.

Called uncompiled, flex_attention runs an unfused reference that materialises the fp32 scores
[B, H, S, S] (0.67 GB per layer and loop for loom_1p7b at micro-batch 8); compiled, it is one
fused kernel. The compiled function object lives at module level because torch.compile keeps its
graphs on that object: one object serves every layer, loop and model of the process (as
TorchTitan does), and creating one per call would compile per call. It is the module's only
state, and it is not ours to mutate. A block compiled by `compile.enable` inlines it.

A module of its own, imported only when a CUDA forward picks flex: creating a compiled function
imports torch._dynamo (seconds), which CPU processes never need.
"""

import torch
from torch.nn.attention.flex_attention import flex_attention

compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
