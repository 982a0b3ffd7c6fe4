"""ParallelDims: the degree of every parallelism, their checks, and the device meshes by name.

Every rank is a data-parallel rank: ``dp_replicate × dp_shard = world size``. Expert parallelism
does not multiply the world: its ``ep`` ranks are carved out of ``dp_shard`` (TorchTitan style), so
an ep group holds ``ep`` data-parallel ranks that each feed their own tokens and each own
``E / ep`` routed experts. Tensor, context and pipeline parallelism are not supported (degree 1).

Meshes (built once by ``build_meshes``; dims of degree 1 are "not enabled"):

  name              shape                               used for
  dp                [dp_replicate · dp_shard]           data loading, loss / count reductions, router grads
  dp_replicate      [dp_replicate]                      HSDP replication axis
  dp_shard          [dp_shard]                          FSDP shard axis of the dense parameters
  fsdp              [dp_shard] or [dp_replicate, dp_shard]            mesh dense parameters are sharded on
  ep                [ep]                                routed experts Shard(0), token all-to-all
  dp_shard_mod_ep   [dp_shard / ep]                     FSDP shard axis of the routed experts
  efsdp             [dp_shard / ep] or [dp_replicate, dp_shard / ep]  mesh expert parameters are sharded on

Rank layout (row-major): rank = (r · dp_shard/ep + m) · ep + e for replica r, expert-shard group m
and ep rank e, so an ep group is ``ep`` consecutive ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_UNSUPPORTED = {"tp": "tensor parallel", "cp": "context parallel", "pp": "pipeline parallel"}
# Mesh name -> (what enables it, the config key to set).
_ENABLED_BY = {
    "dp": ("data parallelism", "more than one rank (parallelism.dp_replicate × dp_shard > 1)"),
    "dp_replicate": ("replicated data parallelism (HSDP)", "parallelism.dp_replicate > 1"),
    "dp_shard": ("FSDP", "parallelism.dp_shard > 1"),
    "fsdp": ("FSDP", "parallelism.dp_shard > 1"),
    "ep": ("expert parallelism", "parallelism.ep > 1"),
    "dp_shard_mod_ep": ("expert parallelism", "parallelism.ep > 1"),
    "efsdp": ("expert parallelism", "parallelism.ep > 1"),
}


def parallelism_problems(
    *,
    dp_replicate: int,
    dp_shard: int,
    ep: int,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    world_size: int,
    num_experts: int | None = None,
) -> list[str]:
    """Every violated rule, one message each, naming the config key (empty list = valid)."""
    errors = []
    for key, value in (("tp", tp), ("cp", cp), ("pp", pp)):
        if value != 1:
            errors.append(
                f"parallelism.{key} = {value}: {_UNSUPPORTED[key]} is not supported; leave it at 1"
            )
    if dp_replicate < 1:
        errors.append(f"parallelism.dp_replicate = {dp_replicate}: must be ≥ 1")
    if dp_shard == 0 or dp_shard < -1:
        errors.append(
            f"parallelism.dp_shard = {dp_shard}: must be ≥ 1, or -1 for the remaining ranks"
        )
    if ep < 1:
        errors.append(f"parallelism.ep = {ep}: must be ≥ 1")
    if errors:
        return errors
    if world_size % dp_replicate:
        return [
            f"parallelism.dp_replicate = {dp_replicate}: must divide the world size {world_size} "
            f"(dp_replicate × dp_shard = world size)"
        ]
    shard = world_size // dp_replicate if dp_shard == -1 else dp_shard
    if dp_replicate * shard != world_size:
        errors.append(
            f"parallelism.dp_shard = {dp_shard}: dp_replicate × dp_shard = {dp_replicate} × {shard} "
            f"= {dp_replicate * shard} ranks, but the world size is {world_size}; use "
            f"{world_size // dp_replicate} or -1"
        )
    elif shard % ep:
        errors.append(
            f"parallelism.ep = {ep}: must divide dp_shard = {shard} (expert-parallel ranks are "
            f"carved from the FSDP ranks); valid: {_divisors(shard)}"
        )
    if num_experts is not None and num_experts % ep:
        errors.append(
            f"parallelism.ep = {ep}: must divide the {num_experts} routed experts "
            f"of the model; valid: {_divisors(num_experts)}"
        )
    return errors


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelDims:
    """Resolved degrees (``dp_shard`` -1 already replaced) and, after ``build_meshes``, the meshes."""

    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int
    origin: str = field(default="", compare=False)
    """How the degrees were chosen, when not as written (parallelism.layout = "auto"): one line."""
    _meshes: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def create(
        cls,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        ep: int = 1,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        world_size: int,
        num_experts: int | None = None,
    ) -> ParallelDims:
        """Check the degrees (ValueError listing every problem) and resolve dp_shard = -1."""
        problems = parallelism_problems(
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            ep=ep,
            tp=tp,
            cp=cp,
            pp=pp,
            world_size=world_size,
            num_experts=num_experts,
        )
        if problems:
            raise ValueError("\n".join(problems))
        shard = world_size // dp_replicate if dp_shard == -1 else dp_shard
        return cls(dp_replicate=dp_replicate, dp_shard=shard, ep=ep, world_size=world_size)

    @classmethod
    def from_config(
        cls, parallelism: Any, world_size: int, num_experts: int | None = None
    ) -> ParallelDims:
        """From the ``[parallelism]`` config section."""
        p = parallelism
        return cls.create(
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            ep=p.ep,
            tp=p.tp,
            cp=p.cp,
            pp=p.pp,
            world_size=world_size,
            num_experts=num_experts,
        )

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """Data-parallel degree (every rank is a data-parallel rank)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_mod_ep(self) -> int:
        """FSDP degree of the routed experts: dp_shard / ep."""
        return self.dp_shard // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP2 shards the parameters (dp_shard > 1); ep > 1 implies it."""
        return self.dp_shard > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def enabled(self, name: str) -> bool:
        """Whether mesh `name` exists for these degrees."""
        sizes = {
            "dp": self.dp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "fsdp": self.dp_shard,
            "ep": self.ep,
            "dp_shard_mod_ep": self.ep,
            "efsdp": self.ep,
        }
        if name not in sizes:
            raise KeyError(f"unknown mesh {name!r}; valid: {', '.join(sizes)}")
        return sizes[name] > 1

    def mesh_shapes(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Every enabled mesh as ((dim name, size), ...), without building anything (dry run)."""
        r, s, m, e = self.dp_replicate, self.dp_shard, self.dp_shard_mod_ep, self.ep
        shapes = {
            "dp": (("dp", self.dp),),
            "dp_replicate": (("dp_replicate", r),),
            "dp_shard": (("dp_shard", s),),
            "fsdp": (("dp_replicate", r), ("dp_shard", s)) if r > 1 else (("dp_shard", s),),
            "ep": (("ep", e),),
            "dp_shard_mod_ep": (("dp_shard_mod_ep", m),),
            "efsdp": (("dp_replicate", r), ("dp_shard_mod_ep", m))
            if r > 1
            else (("dp_shard_mod_ep", m),),
        }
        return {name: dims for name, dims in shapes.items() if self.enabled(name)}

    # ------------------------------------------------------------------ meshes
    def build_meshes(self, device_type: str) -> None:
        """Create the meshes on the initialised default process group (no-op on one rank)."""
        if self.world_size == 1 or self._meshes:
            return
        from torch.distributed.device_mesh import init_device_mesh

        dense = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
        meshes = {
            "dp": dense._flatten("dp"),
            "dp_replicate": dense["dp_replicate"],
            "dp_shard": dense["dp_shard"],
            "fsdp": dense if self.dp_replicate > 1 else dense["dp_shard"],
        }
        if self.ep > 1:
            # Split the FSDP axis into (dp_shard_mod_ep, ep): the same root mesh, so FSDP on
            # efsdp composes with the experts' Shard(0) over ep into one 2-D (or 3-D) layout.
            sparse = dense._unflatten(1, (self.dp_shard_mod_ep, self.ep), ("dp_shard_mod_ep", "ep"))
            meshes.update(
                ep=sparse["ep"],
                dp_shard_mod_ep=sparse["dp_shard_mod_ep"],
                efsdp=sparse["dp_replicate", "dp_shard_mod_ep"]
                if self.dp_replicate > 1
                else sparse["dp_shard_mod_ep"],
            )
        self._meshes = {name: mesh for name, mesh in meshes.items() if self.enabled(name)}

    def get_mesh(self, name: str) -> Any:
        """The mesh called `name`; raises ValueError saying which parallelism enables it."""
        if not self.enabled(name):
            what, how = _ENABLED_BY[name]
            raise ValueError(f"mesh {name!r} does not exist: {what} is not enabled (set {how})")
        if name not in self._meshes:
            raise RuntimeError(
                f"mesh {name!r}: call ParallelDims.build_meshes(device_type) after the process "
                f"group is initialised"
            )
        return self._meshes[name]

    def get_optional_mesh(self, name: str) -> Any | None:
        """The mesh called `name`, or None when its parallelism is not enabled."""
        return self.get_mesh(name) if self.enabled(name) else None

    def describe(self) -> str:
        """One line per enabled mesh (dry run and the trainer's start-up log)."""
        lines = [
            f"world {self.world_size} = dp_replicate {self.dp_replicate} × dp_shard {self.dp_shard}"
            + (
                f" (dp_shard = dp_shard_mod_ep {self.dp_shard_mod_ep} × ep {self.ep})"
                if self.ep > 1
                else ""
            )
        ]
        if self.origin:
            lines.append(f"  {self.origin}")
        for name, dims in self.mesh_shapes().items():
            lines.append(f"  mesh {name:<16} " + " × ".join(f"{d}={n}" for d, n in dims))
        if len(lines) == 1:
            lines.append("  no meshes (one process)")
        return "\n".join(lines)
