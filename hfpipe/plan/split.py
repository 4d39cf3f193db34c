"""Stage planning: which decoder layers, embedding and head each pipeline stage holds.

Pure functions of a transformers config and the pipeline shape: no process group, no weights, no
files. The model is split into ``pp * vpp`` contiguous stages; ``style`` maps stages to ranks.
Costs come from :mod:`hfpipe.plan.cost`: a parameter count of the real transformers model built on the
meta device, so the planner knows every architecture transformers knows.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from hfpipe.errors import PlanError
from hfpipe.parallel.dims import check_degrees
from hfpipe.parallel.rules import SCHEDULES, STYLES, V_SCHEDULES, required_vpp, schedule_style, style_vpp
from hfpipe.plan.cost import CostModel, layer_costs
from hfpipe.models.spec import StageSpec

__all__ = [
    "METHODS", "SCHEDULES", "STYLES", "CostModel", "Plan", "PlanError", "StageSpec",
    "balanced_partition", "bubble_fraction", "idle_ranks", "layer_costs", "parse_layout", "plan_pipeline",
]

METHODS = ("balanced", "even", "weighted", "layout")


@dataclass(frozen=True)
class Plan:
    """All stages of a pipeline and the stage → rank map."""

    stages: tuple[StageSpec, ...]
    pp: int  # pipeline ranks
    vpp: int  # stages per rank
    style: str  # "loop": rank r holds stages r, r+pp, r+2pp, ...; "v": rank r holds r and 2pp-1-r

    def __post_init__(self):
        _check_shape(self.pp, self.vpp, self.style)
        if len(self.stages) != self.pp * self.vpp:
            raise PlanError(f"a plan for --pp {self.pp} x --vpp {self.vpp} needs "
                            f"{self.pp * self.vpp} stages, got {len(self.stages)}")

    def rank_of_stage(self, index: int) -> int:
        """The pipeline rank that runs stage ``index``."""
        if not 0 <= index < len(self.stages):
            raise PlanError(f"stage {index} is outside 0..{len(self.stages) - 1}")
        if self.style == "v" and index >= self.pp:
            return 2 * self.pp - 1 - index
        return index % self.pp

    @property
    def owners(self) -> list[int]:
        """The pipeline rank of every stage, in stage order (what the schedules' send and receive follow)."""
        return [self.rank_of_stage(s.index) for s in self.stages]

    def stages_of_rank(self, rank: int) -> list[StageSpec]:
        """The stages rank ``rank`` runs, in increasing stage index."""
        if not 0 <= rank < self.pp:
            raise PlanError(f"rank {rank} is outside 0..{self.pp - 1} (--pp {self.pp})")
        return [s for s in self.stages if self.rank_of_stage(s.index) == rank]

    @property
    def balance(self) -> float:
        """Largest stage cost over the mean stage cost: 1.0 is perfect balance."""
        costs = [s.cost for s in self.stages]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean > 0 else 1.0



def plan_pipeline(config, pp: int, *, vpp: int = 1, style: str = "loop", method: str = "balanced",
                  layout: str | None = None, embed_weight: float | None = None,
                  head_weight: float | None = None, seq_len: int = 4096) -> Plan:
    """Split a model into ``pp * vpp`` pipeline stages.

    Args:
        config: A transformers ``PretrainedConfig`` of a causal LM.
        pp: Pipeline ranks.
        vpp: Stages per rank (virtual pipeline size).
        style: ``"loop"`` or ``"v"`` (needs ``vpp == 2``); only the stage → rank map differs.
        method: ``"balanced"`` (least costly costliest stage), ``"even"`` (earlier stages take
            the extra layer), ``"weighted"`` (even, counting embedding and head as layers).
        layout: Megatron-style layout (see :func:`parse_layout`); overrides ``method``.
        embed_weight: The embedding's cost in decoder layers (weighted: default 1; balanced:
            default from the cost model, else this many mean layers).
        head_weight: The head's cost in decoder layers, like ``embed_weight``.
        seq_len: Training sequence length, for attention costs.

    Returns:
        The :class:`Plan`.
    """
    _check_shape(pp, vpp, style)
    if method not in METHODS:
        raise PlanError(f"unknown --plan-method {method!r}; choose one of {', '.join(METHODS)}")
    for flag, weight in (("--embed-weight", embed_weight), ("--head-weight", head_weight)):
        if weight is not None and weight < 0:
            raise PlanError(f"{flag} must be >= 0, got {weight}")
    costs = layer_costs(config, seq_len)
    if layout is not None or method == "layout":
        tokens = _layout_tokens(layout, costs, pp, vpp)
    else:
        counts = _layer_counts(method, costs, pp, vpp, embed_weight, head_weight)
        last = len(counts) - 1
        tokens = [["E"] * (s == 0) + ["t"] * c + ["L"] * (s == last) for s, c in enumerate(counts)]
    return Plan(_stages(tokens, costs), pp, vpp, style)


def _check_shape(pp: int, vpp: int, style: str) -> None:
    check_degrees(pp=pp)
    if vpp < 1:
        raise PlanError(f"--vpp must be >= 1, got {vpp}")
    if style not in STYLES:
        raise PlanError(f"unknown pipeline style {style!r}; choose one of {', '.join(STYLES)}")
    need = style_vpp(style)
    if need is not None and vpp != need:
        raise PlanError(f"the V style (--schedule {' or '.join(V_SCHEDULES)}) puts two stages on each rank; "
                        f"use --vpp {need} (got --vpp {vpp})")


def _layer_counts(method: str, costs: CostModel, pp: int, vpp: int, embed_weight: float | None,
                  head_weight: float | None) -> tuple[int, ...]:
    """Decoder layers per stage for the even, weighted and balanced methods."""
    n, num_stages = len(costs.layers), pp * vpp
    if num_stages > n:
        raise PlanError(f"--pp {pp} x --vpp {vpp} = {num_stages} stages but the model has {n} "
                        "decoder layers; reduce --pp or --vpp")
    if method == "even":
        return tuple(n // num_stages + (s < n % num_stages) for s in range(num_stages))
    if method == "weighted":
        first = 1.0 if embed_weight is None else embed_weight
        last = 1.0 if head_weight is None else head_weight
        return balanced_partition([1.0] * n, num_stages, first=first, last=last)
    mean = sum(costs.layers) / n
    first = costs.embed if embed_weight is None else embed_weight * mean
    last = costs.head if head_weight is None else head_weight * mean
    return balanced_partition(costs.layers, num_stages, first=first, last=last)


def balanced_partition(costs, num_stages: int, *, first: float = 0.0,
                       last: float = 0.0) -> tuple[int, ...]:
    """Split a cost list into contiguous stages minimising the costliest stage (exact DP).

    Among optimal splits, each stage in turn takes the fewest items reaching an even share of what
    is left: uniform costs give the even split, earlier stages taking the extra item.

    Args:
        costs: Non-negative cost of each item (decoder layer), in order.
        num_stages: Stages; each gets at least one item.
        first: Extra cost on the first stage (the embedding).
        last: Extra cost on the last stage (the head).

    Returns:
        Items per stage.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise PlanError(f"cannot split {n} decoder layers into {num_stages} non-empty stages; "
                        "reduce --pp or --vpp")
    prefix = list(itertools.accumulate(costs, initial=0.0))

    def cost(i: int, j: int) -> float:  # stage holding items i..j-1
        return prefix[j] - prefix[i] + (first if i == 0 else 0.0) + (last if j == n else 0.0)

    best = _suffix_optima(cost, n, num_stages)
    bound = best[num_stages][0]
    counts, i = [], 0
    for left in range(num_stages, 0, -1):
        share = cost(i, n) / left
        fits = [j for j in range(i + 1, n - left + 2)
                if cost(i, j) <= bound and best[left - 1][j] <= bound]
        j = next((j for j in fits if cost(i, j) >= share * (1 - 1e-12)), fits[-1])
        counts.append(j - i)
        i = j
    return tuple(counts)


def _suffix_optima(cost, n: int, num_stages: int) -> list[list[float]]:
    """``best[k][i]``: the least possible costliest stage when items ``i..n-1`` fill k stages."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(n - k, -1, -1):
            for j in range(i + 1, n - k + 2):
                c = cost(i, j)
                if c >= best[k][i]:
                    break  # stage cost only grows with j
                best[k][i] = min(best[k][i], max(c, best[k - 1][j]))
    return best


def parse_layout(layout: str, num_layers: int, num_mtp: int = 0) -> list[list[str]]:
    """Parse and check a Megatron-style pipeline layout, e.g. ``"Et*3|(tt|)*29,m|L"``.

    Tokens: ``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` norm + head + loss. ``|``
    ends a stage (stages may be empty), ``*N`` repeats the preceding token or ``(group)``; commas
    and spaces are cosmetic.

    Args:
        layout: The layout string (the ``--layout`` option).
        num_layers: Decoder layers of the model: the number of ``t`` required.
        num_mtp: MTP layers of the model: the most ``m`` allowed.

    Returns:
        Per stage, its tokens in order.
    """
    stages: list[list[str]] = [[]]
    for symbol in _expand(layout):
        if symbol == "|":
            stages.append([])
        else:
            stages[-1].append(symbol)
    _check_layout(stages, num_layers, num_mtp)
    return stages


def _expand(layout: str) -> list[str]:
    """Flatten groups and repeats into symbols ``E t m L |``."""
    levels: list[list[list[str]]] = [[]]  # open groups; each holds items (lists of symbols)
    pos = 0
    while pos < len(layout):
        char = layout[pos]
        if char in "EtmL|":
            levels[-1].append([char])
        elif char == "(":
            levels.append([])
        elif char == ")":
            if len(levels) == 1:
                raise PlanError(f"--layout has an unmatched ')' at position {pos}: {layout!r}")
            group = levels.pop()
            levels[-1].append([s for item in group for s in item])
        elif char == "*":
            count = re.match(r"\d+", layout[pos + 1:])
            if not count or not levels[-1]:
                raise PlanError(f"--layout '*' at position {pos} must follow a token or group "
                                f"and precede a count, as in 't*4': {layout!r}")
            levels[-1][-1] = levels[-1][-1] * int(count.group())
            pos += len(count.group())
        elif char not in ", \t\n":
            raise PlanError(f"--layout has unknown character {char!r} at position {pos}; "
                            "use E, t, m, L, |, (, ), *N and commas")
        pos += 1
    if len(levels) != 1:
        raise PlanError(f"--layout has {len(levels) - 1} unclosed '('; add ')': {layout!r}")
    return [s for item in levels[0] for s in item]


def _check_layout(stages: list[list[str]], num_layers: int, num_mtp: int) -> None:
    """Raise PlanError naming the fix unless the layout holds the model exactly once, in order."""
    flat = [s for stage in stages for s in stage]
    found, mtp = flat.count("t"), flat.count("m")
    if found != num_layers:
        fix = f"add {_words(num_layers - found)}" if found < num_layers else (
            f"remove {_words(found - num_layers)}")
        raise PlanError(f"--layout has {found} 't' layers but the model has {num_layers} decoder "
                        f"layers; {fix} 't'")
    if mtp and not num_mtp:
        raise PlanError("--layout has 'm' but the model has no MTP layers "
                        "(num_nextn_predict_layers is 0); remove the 'm'")
    if mtp > num_mtp:
        raise PlanError(f"--layout has {mtp} 'm' layers but the model has {num_mtp} MTP "
                        f"layer(s); remove {_words(mtp - num_mtp)} 'm'")
    for token, where, name in (("E", "first", "the embedding"), ("L", "last", "the head")):
        if flat.count(token) != 1:
            raise PlanError(f"--layout needs exactly one '{token}' ({name}), found "
                            f"{flat.count(token)}; put one in the {where} stage")
    if "E" not in stages[0] or "t" in stages[0][: stages[0].index("E")]:
        raise PlanError("--layout must put 'E' in the first stage, before any 't'")
    if "L" not in stages[-1] or "t" in stages[-1][stages[-1].index("L"):]:
        raise PlanError("--layout must put 'L' in the last stage, after every 't'")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        raise PlanError("--layout must put every 'm' after the last 't' (MTP reads the final "
                        "hidden states)")


def _words(n: int) -> str:
    return "one" if n == 1 else str(n)


def _layout_tokens(layout: str | None, costs: CostModel, pp: int, vpp: int) -> list[list[str]]:
    """The stages of a ``--layout``, checked against the model and the pipeline shape."""
    if layout is None:
        raise PlanError("--plan-method layout needs a --layout string, e.g. 'Et*2|t*2L'")
    tokens = parse_layout(layout, len(costs.layers), costs.num_mtp)
    if len(tokens) != pp * vpp:
        raise PlanError(f"--layout makes {len(tokens)} stages but --pp {pp} x --vpp {vpp} = "
                        f"{pp * vpp}; change --layout or --pp/--vpp to match")
    return tokens


def _stages(tokens: list[list[str]], costs: CostModel) -> tuple[StageSpec, ...]:
    """StageSpecs from per-stage tokens, decoder and MTP layers numbered in order."""
    stages, next_layer, next_mtp = [], 0, len(costs.layers)
    for index, stage in enumerate(tokens):
        layers = tuple(range(next_layer, next_layer + stage.count("t")))
        mtp = tuple(range(next_mtp, next_mtp + stage.count("m")))
        next_layer, next_mtp = next_layer + len(layers), next_mtp + len(mtp)
        embed, head = "E" in stage, "L" in stage
        # MTP layers cost nothing: the loader skips them (transformers has no module to run them),
        # so a stage of only 'm' idles its rank; a layout should fold 'm' into the head's stage
        cost = sum(costs.layers[i] for i in layers) + costs.embed * embed + costs.head * head
        stages.append(StageSpec(index, layers, embed, head, mtp, cost))
    return tuple(stages)


def idle_ranks(plan: Plan) -> list[str]:
    """A line per rank with nothing to run (no layer, embedding or head: a stage of only MTP)."""
    idle = [r for r in range(plan.pp)
            if not any(s.layers or s.embed or s.head for s in plan.stages_of_rank(r))]
    return [f"rank {r} runs nothing (its stages hold only MTP layers, which hfpipe skips): fold "
            "'m' into the head's stage of --layout (e.g. ...|t,mL) to give it work" for r in idle]


def bubble_fraction(schedule: str, pp: int, vpp: int, microbatches: int) -> float:
    """Idle share of a rank's step, ``idle / (idle + m)``, for uniform stages (analytic).

    Unit: one rank's forward + input-grad + weight-grad backward of one microbatch, taken as equal
    thirds (F = B = W = 1/3). Idle time per rank, p = ``pp``, v = ``vpp``:
    ``gpipe``, ``1f1b``: p-1, i.e. (p-1)/(m+p-1). ``interleaved-1f1b``, ``looped-bfs``: (p-1)/v.
    ``interleaved-zb`` (ZB-H1 on v chunks): (p-1)(F+B-W)/v = (p-1)/(3v). ``zbv`` (ZB-V, Qi et
    al. 2024): (p-1)(F+B-2W) on half-stage chunks = 0, as the paper states (needs m >= 2p).
    ``dualpipev``: DualPipe's (PP/2-1)(F&B+B_full-3W) on 2p virtual ranks of half-stage chunks,
    F&B = F + B_full (the overlap hides communication, not compute) = (p-1)/3.

    Args:
        schedule: One of :data:`hfpipe.parallel.rules.SCHEDULES`.
        pp: Pipeline ranks.
        vpp: Stages per rank.
        microbatches: Microbatches per step (m).

    Returns:
        The idle fraction, in ``[0, 1)``.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown --schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    check_degrees(pp=pp)
    for flag, value in (("--vpp", vpp), ("--microbatches", microbatches)):
        if value < 1:
            raise PlanError(f"{flag} must be >= 1, got {value}")
    # The stages per rank the rules fix, given explicitly (no "1 means the default" here): a formula's domain.
    need = required_vpp(schedule)
    if need is not None and vpp != need:
        raise PlanError(f"--schedule {schedule} runs " + (
            f"two stages per rank in a V; use --vpp {need}" if schedule_style(schedule) == "v" else
            f"one stage per rank; use --vpp {need} or --schedule interleaved-1f1b"))
    idle = {"gpipe": pp - 1, "1f1b": pp - 1, "interleaved-1f1b": (pp - 1) / vpp,
            "looped-bfs": (pp - 1) / vpp, "interleaved-zb": (pp - 1) / (3 * vpp), "zbv": 0.0,
            "dualpipev": (pp - 1) / 3}[schedule]
    return idle / (idle + microbatches)
