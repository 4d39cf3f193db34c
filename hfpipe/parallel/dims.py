"""The one owner of the rank layout: the parallel degrees, validated once, and every rank's coordinates.

The world is one mesh in a fixed order, outermost first: ``pp, dp, cp, tp`` (:data:`MESH_DIMS`).
tp innermost keeps a tensor-parallel group on consecutive ranks, inside one node, where its
per-layer collectives have the fast links; pp outermost sends only activations between nodes. This
is torchtitan's and picotron's order. Expert parallelism is carved out of dp: ``dp = edp x ep``
with ep innermost, so an ep group is ``ep`` consecutive dp ranks at one (pp, cp, tp) coordinate.

Everything here is arithmetic on ranks (no process group), so the layout of any mesh is unit-tested
(``tests/parallel/test_parallel_dims.py``). Nothing else in hfpipe turns coordinates into ranks or back: the
process groups are built from these lists by :mod:`hfpipe.parallel.mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hfpipe.errors import ParallelError

__all__ = ["MESH_DIMS", "EXPERT_DIMS", "ParallelDims", "check_degrees"]

#: The world mesh's dimensions, outermost first.
MESH_DIMS = ("pp", "dp", "cp", "tp")
#: The expert view of the same ranks: dp split into (edp, ep).
EXPERT_DIMS = ("pp", "edp", "ep", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """The degree of every axis.

    Attributes:
        pp: Pipeline ranks (stages are spread over them).
        dp: Data-parallel replicas (FSDP2 shards over them).
        cp: Context-parallel ranks (one sequence split over them); 1 by default.
        tp: Tensor-parallel ranks (each matrix split over them); 1 by default.
        ep: Expert-parallel ranks, carved out of dp (routed experts sharded over them).
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        check_degrees(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The world mesh's shape, in :data:`MESH_DIMS` order."""
        return self.pp, self.dp, self.cp, self.tp

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Replicas of each expert shard: the dp ranks holding the same experts."""
        return self.dp // self.ep

    @property
    def expert_shape(self) -> tuple[int, ...]:
        """The world's ranks seen as :data:`EXPERT_DIMS` (the same order, dp split into edp x ep)."""
        return self.pp, self.edp, self.ep, self.cp, self.tp

    @property
    def batch_dims(self) -> tuple[str, ...]:
        """Ranks that see different tokens of one step: their losses and token counts are summed."""
        return ("dp", "cp") if self.cp > 1 else ("dp",)

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Ranks FSDP2 shards a stage's parameters over (and averages their gradients over)."""
        return self.batch_dims

    @property
    def expert_replica_dims(self) -> tuple[str, ...]:
        """Ranks of the expert view holding the same routed experts, which see different tokens: FSDP2 shards
        the experts over them and sums their gradients. edp; cp (other tokens of the same rows); tp (each tp
        rank dispatches its own slice of the replica's tokens, transformers' ``AllToAllEP``)."""
        return ("edp",) + tuple(d for d in ("cp", "tp") if getattr(self, d) > 1)

    @property
    def grad_divide_factor(self) -> int:
        """What FSDP divides a summed gradient by (it averages over :attr:`fsdp_dims`): each rank's loss is
        scaled up by it, so that the step's gradient is the sum over every token / the global count."""
        return self.dp * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on each of :data:`MESH_DIMS`."""
        out = {}
        for name, size in reversed(tuple(zip(MESH_DIMS, self.shape))):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in MESH_DIMS}

    def rank_of(self, **coords: int) -> int:
        """The global rank at ``coords`` (dimensions left out are 0)."""
        rank = 0
        for name, size in zip(MESH_DIMS, self.shape):
            rank = rank * size + coords.get(name, 0)
        return rank

    def group_ranks(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but those on ``dims``, in mesh order."""
        me = self.coords(rank)
        sizes = dict(zip(MESH_DIMS, self.shape))
        ranks = [me]
        for name in dims:
            ranks = [{**c, name: i} for c in ranks for i in range(sizes[name])]
        return sorted(self.rank_of(**c) for c in ranks)

    def pp_peer(self, rank: int, pp_rank: int) -> int:
        """The rank at pipeline position ``pp_rank`` in ``rank``'s replica."""
        return self.rank_of(**{**self.coords(rank), "pp": pp_rank})

    def tied_pairs(self, first: int, last: int) -> list[list[int]]:
        """The ``{pipeline rank first, pipeline rank last}`` pair of every replica: a tied embedding's two
        copies, whose gradient halves are summed. One pair per (dp, cp, tp) coordinate."""
        return [[self.pp_peer(r, first), self.pp_peer(r, last)]
                for r in range(self.world) if self.coords(r)["pp"] == 0]


def check_degrees(call: str | None = None, **degrees) -> None:
    """Each degree an integer >= 1, and ep dividing dp; told in flags, or in ``call``'s arguments.

    The Python API passes ``call="load_pipeline"`` so that its errors name arguments, not flags.
    """
    def name(key: str, value) -> str:
        return f"--{key}" if call is None else f"{call}({key}={value!r}): {key}"

    for key, value in degrees.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParallelError(f"{name(key, value)} must be {'>=' if call is None else 'an integer >='} 1, "
                                f"got {value!r}")
    ep, dp = degrees.get("ep", 1), degrees.get("dp", 1)
    if dp % ep:
        where = f"--ep ({ep}) must divide --dp ({dp})" if call is None else f"{call}(ep={ep}): ep must divide dp ({dp})"
        raise ParallelError(f"{where}: experts are sharded over ep ranks of the data-parallel group; "
                            "raise dp or lower ep")
