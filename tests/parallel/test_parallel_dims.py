"""Spec of hfpipe.parallel.dims: the one rank layout, checked for many meshes without a process group.

The world is ``pp, dp, cp, tp`` outermost first, so tp groups are consecutive ranks (one node's),
and ep is carved out of dp with ep innermost. Every named group below is what a reduction means:
a test here is the only place rank arithmetic is spelled out by hand.
"""

import itertools
import math

import pytest
import torch

from hfpipe.errors import ConfigError, ParallelError
from hfpipe.parallel.dims import MESH_DIMS, ParallelDims, check_degrees
from hfpipe.parallel.rules import check_layout

MESHES = [dict(pp=1), dict(pp=4), dict(pp=2, dp=2), dict(pp=2, dp=4, ep=2), dict(pp=2, dp=2, tp=2),
          dict(pp=2, dp=2, cp=2, tp=2), dict(pp=3, dp=2, cp=2), dict(pp=2, dp=4, ep=4, tp=2)]


@pytest.mark.parametrize("degrees", MESHES)
def test_coords_and_rank_of_are_inverse_and_tp_is_innermost(degrees):
    dims = ParallelDims(**degrees)
    grid = torch.arange(dims.world).view(dims.shape)  # what init_device_mesh lays out
    for rank in range(dims.world):
        c = dims.coords(rank)
        assert dims.rank_of(**c) == rank
        assert int(grid[tuple(c[n] for n in MESH_DIMS)]) == rank
    if dims.tp > 1:  # a tp group is tp consecutive ranks
        assert dims.group_ranks(0, ("tp",)) == list(range(dims.tp))


@pytest.mark.parametrize("degrees", MESHES)
def test_every_named_group_partitions_the_world(degrees):
    dims = ParallelDims(**degrees)
    for names in [("pp",), ("dp",), ("cp",), ("tp",), dims.batch_dims, dims.fsdp_dims]:
        groups = {tuple(dims.group_ranks(r, names)) for r in range(dims.world)}
        assert sorted(itertools.chain(*groups)) == list(range(dims.world))
        size = 1
        for n in names:
            size *= getattr(dims, n)
        assert all(len(g) == size for g in groups)
        for g in groups:  # the members differ only on `names`
            others = {tuple(v for k, v in dims.coords(r).items() if k not in names) for r in g}
            assert len(others) == 1


def test_the_pipeline_is_outermost_so_a_replica_sits_on_one_rank_per_stage():
    dims = ParallelDims(pp=2, dp=2, tp=2)
    assert dims.group_ranks(0, ("pp",)) == [0, 4]
    assert dims.group_ranks(0, ("dp",)) == [0, 2]
    assert dims.group_ranks(5, ("tp",)) == [4, 5]
    assert dims.pp_peer(3, 1) == 7


def test_the_expert_view_splits_dp_into_edp_and_ep_with_ep_innermost():
    dims = ParallelDims(pp=2, dp=4, ep=2)
    view = torch.arange(dims.world).view(dims.expert_shape)  # (pp, edp, ep, cp, tp)
    assert view[0, :, :, 0, 0].tolist() == [[0, 1], [2, 3]]  # ep groups: consecutive dp ranks
    assert view[1, 1, :, 0, 0].tolist() == [6, 7]
    assert dims.edp == 2


def test_tied_pairs_join_the_first_and_last_pipeline_rank_of_every_replica():
    assert ParallelDims(pp=3, dp=2).tied_pairs(0, 2) == [[0, 4], [1, 5]]
    assert ParallelDims(pp=2, dp=1, tp=2).tied_pairs(0, 1) == [[0, 2], [1, 3]]


def test_the_gradient_divide_factor_is_the_fsdp_domain():
    assert ParallelDims(pp=2, dp=4, ep=2).grad_divide_factor == 4
    assert ParallelDims(pp=2, dp=2, cp=2, tp=2).grad_divide_factor == 4  # tp ranks see the same tokens
    assert ParallelDims(dp=2, cp=2).batch_dims == ("dp", "cp")


@pytest.mark.parametrize("degrees, says", [
    (dict(pp=0), "--pp must be >= 1, got 0"),
    (dict(tp=-1), "--tp must be >= 1, got -1"),
    (dict(cp="2"), "--cp must be >= 1, got '2'"),
    (dict(dp=3, ep=2), "--ep (2) must divide --dp (3)"),
])
def test_bad_degrees_are_one_parallel_error_naming_the_flag(degrees, says):
    with pytest.raises(ParallelError) as e:
        ParallelDims(**degrees)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    assert isinstance(e.value, ConfigError)  # the CLI and the config catch it as one


def test_the_api_phrasing_names_the_argument():
    with pytest.raises(ParallelError, match=r"^load_pipeline\(ep=None\): ep must be an integer >= 1"):
        check_degrees("load_pipeline", dp=2, ep=None)
    with pytest.raises(ParallelError, match=r"^load_pipeline\(ep=2\): ep must divide dp \(3\)"):
        check_degrees("load_pipeline", dp=3, ep=2)


@pytest.mark.parametrize("schedule, vpp, want", [("1f1b", None, 1), ("interleaved-1f1b", None, 2),
                                                 ("interleaved-1f1b", 1, 2), ("looped-bfs", 3, 3), ("zbv", 1, 2)])
def test_the_layout_resolves_stages_per_rank_and_microbatches_once(schedule, vpp, want):
    layout = check_layout(ParallelDims(pp=2), schedule, vpp=vpp)
    assert layout.vpp == want and layout.microbatches == 2 * want


def test_one_message_for_ep_with_a_zero_bubble_schedule_wherever_it_is_given():
    """The CLI's config, the API and plan all call check_layout: dp > 1 with zbv is refused once, the same."""
    with pytest.raises(ParallelError, match="zero-bubble schedules leave FSDP's gradients empty"):
        check_layout(ParallelDims(pp=2, dp=2, ep=2), "zbv", microbatches=4)


@pytest.mark.parametrize("change, says", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is more than the 8 routed experts"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0 leaves the experts no width"),
])
def test_an_impossible_moe_config_is_refused_by_plan_and_the_layout_alike(change, says):
    """plan once answered as if these were fine, finetune crashed in a worker; one rule now."""
    from hfpipe.plan.report import plan_report
    from hfpipe.tiny import tiny_config

    config = tiny_config("deepseek_v3")
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ParallelError, match=says):
        check_layout(ParallelDims(pp=2), model_config=config)
    with pytest.raises(ParallelError, match=says):
        plan_report(config, 2, seq_len=16)


@pytest.mark.parametrize("degrees, dims", [
    (dict(pp=2, dp=4, ep=2), ("edp",)),
    (dict(pp=2, dp=2, ep=2, cp=2), ("edp", "cp")),
    (dict(pp=2, dp=2, ep=2, tp=2), ("edp", "tp")),
    (dict(pp=2, dp=4, ep=2, tp=2), ("edp", "tp")),
])
def test_an_expert_replica_group_holds_the_same_experts_and_sees_different_tokens(degrees, dims):
    """The ranks FSDP2 shards a routed expert over, and sums its gradient over: every rank at one (pp, ep)
    coordinate, each seeing other tokens. Under tp each tp rank dispatches its own slice of the tokens its
    replica shares, so tp is one of them."""
    layout = ParallelDims(**degrees)
    assert layout.expert_replica_dims == dims
    view = torch.arange(layout.world).view(layout.expert_shape)  # (pp, edp, ep, cp, tp)
    for pp, ep in itertools.product(range(layout.pp), range(layout.ep)):
        group = view[pp, :, ep].flatten().tolist()  # the experts this (pp, ep) coordinate holds
        assert len(group) == math.prod(getattr(layout, d) for d in dims)  # every one of them, no other


def test_tp_with_ep_is_accepted_and_tp_with_ep_and_cp_is_refused_in_one_line():
    from hfpipe.tiny import tiny_config

    config = tiny_config("deepseek_v3", num_hidden_layers=4)
    layout = check_layout(ParallelDims(pp=2, dp=2, ep=2, tp=2), "1f1b", microbatches=2, model_config=config)
    assert layout.dims.tp == layout.dims.ep == 2
    with pytest.raises(ParallelError, match=r"^--cp 2 with --tp 2: ") as e:
        check_layout(ParallelDims(pp=2, dp=2, ep=2, tp=2, cp=2), "1f1b", microbatches=2, model_config=config)
    assert "\n" not in str(e.value)
