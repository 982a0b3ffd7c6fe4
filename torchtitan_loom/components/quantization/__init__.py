"""Low-precision training: float8 conversion of dense linears and routed experts (torchao)."""
