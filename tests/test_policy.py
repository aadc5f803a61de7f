"""The director's rules and the filters' orderings, as pure functions of the
facts the residency manager measures (csrc/core/policy/)."""
import pytest

from membudget._native import load_extension

pytestmark = pytest.mark.requires_native
MiB = 1 << 20


@pytest.fixture(scope="module")
def core():
    return load_extension().core


def test_director_picks_the_smaller_stall(core):
    facts = dict(bytes=100 * MiB, recomputable=True, link_bytes_per_s=1e9, seconds_until_next_use=0.0)
    slow_link = core.decide(dict(facts, recompute_seconds=0.01))
    assert slow_link["action"] == "recompute"
    assert slow_link["swap_stall_seconds"] == pytest.approx(2 * 100 * MiB / 1e9)
    expensive_replay = core.decide(dict(facts, recompute_seconds=1.0))
    assert expensive_replay["action"] == "swap"


def test_time_until_next_use_hides_the_copy_in(core):
    facts = dict(bytes=100 * MiB, recomputable=True, link_bytes_per_s=1e9, recompute_seconds=0.15)
    assert core.decide(dict(facts, seconds_until_next_use=0.0))["action"] == "recompute"
    far = core.decide(dict(facts, seconds_until_next_use=10.0))
    assert far["action"] == "swap" and far["swap_stall_seconds"] == pytest.approx(100 * MiB / 1e9)


def test_queued_copies_count_against_swapping(core):
    facts = dict(bytes=10 * MiB, recomputable=True, link_bytes_per_s=1e9, recompute_seconds=0.05,
                 seconds_until_next_use=1.0)
    assert core.decide(facts)["action"] == "swap"
    assert core.decide(dict(facts, d2h_queued_bytes=200 * MiB))["action"] == "recompute"


def test_director_hard_rules(core):
    base = dict(bytes=MiB, link_bytes_per_s=1e9)
    assert core.decide(dict(base, recomputable=False, recompute_seconds=0.0))["reason"] == "not recomputable"
    full = core.decide(dict(base, recomputable=True, host_room=False, recompute_seconds=5.0))
    assert (full["action"], full["reason"]) == ("recompute", "host tier full")
    free = core.decide(dict(base, recomputable=False, host_valid=True))
    assert (free["action"], free["reason"]) == ("swap", "host copy already valid")
    # A host copy saves the copy-out only: a replay cheaper than the copy-in wins.
    cheap = core.decide(dict(base, recomputable=True, host_valid=True, recompute_seconds=1e-6))
    assert cheap["action"] == "recompute"
    assert cheap["swap_stall_seconds"] == pytest.approx(MiB / 1e9)
    costly = core.decide(dict(base, recomputable=True, host_valid=True, recompute_seconds=1.0))
    assert costly["action"] == "swap"
    assert core.decide(dict(base, recomputable=True), "swap")["reason"] == "actions=swap"
    assert core.decide(dict(base, recomputable=True, recompute_seconds=9.0), "recompute")["action"] == "recompute"
    assert core.decide(dict(base, recomputable=False), "recompute")["action"] == "none"
    assert core.decide(dict(base, recomputable=False, host_room=False))["action"] == "none"
    with pytest.raises(ValueError, match="swap, recompute, both"):
        core.decide(dict(base), "drop")


def test_a_victim_whose_copy_out_is_under_way_waits_for_it_either_way(core):
    # Note [Copy under way]: its memory is read by the copy until the copy
    # ends, so a drop frees nothing sooner than a swap; the wait is part of
    # both stalls, and the choice turns on the copy-in against the replay.
    facts = dict(bytes=100 * MiB, recomputable=True, link_bytes_per_s=1e9, recompute_seconds=0.01,
                 seconds_until_next_use=10.0, d2h_queued_bytes=50 * MiB)
    idle = core.decide(facts)
    assert idle["recompute_stall_seconds"] == pytest.approx(0.01)
    busy = core.decide(dict(facts, copy_out_in_flight=True))
    wait = 150 * MiB / 1e9
    assert busy["recompute_stall_seconds"] == pytest.approx(wait + 0.01)
    assert busy["swap_stall_seconds"] == pytest.approx(wait)
    assert busy["action"] == "swap"  # the copy-in is hidden 10 s ahead; the replay is not free
    needed_now = core.decide(dict(facts, copy_out_in_flight=True, seconds_until_next_use=0.0))
    assert needed_now["action"] == "recompute"


def test_dtr_prefers_large_stale_cheap_victims(core):
    cheap = dict(bytes=MiB, last_access=0, cost_seconds=0.001)
    assert core.filter_score("dtr", cheap, 10) > core.filter_score("dtr", dict(cheap, cost_seconds=0.01), 10)
    assert core.filter_score("dtr", cheap, 10) > core.filter_score("dtr", dict(cheap, last_access=9), 10)
    assert core.filter_score("dtr", dict(cheap, bytes=2 * MiB), 10) > core.filter_score("dtr", cheap, 10)
    # An evicted neighbourhood makes evicting it costlier (its replay would
    # trigger theirs).
    assert core.filter_score("dtr", cheap, 10) > core.filter_score("dtr", dict(cheap, neighbourhood_seconds=0.1), 10)


def test_msps_is_memory_saved_per_second(core):
    a = core.filter_score("msps", dict(bytes=4 * MiB, cost_seconds=0.002), 0)
    b = core.filter_score("msps", dict(bytes=MiB, cost_seconds=0.001), 0)
    assert a == pytest.approx(2 * b, rel=1e-3)


def test_delta_prefers_far_next_use_and_cheap_actions(core):
    near = dict(bytes=MiB, seconds_until_next_use=0.001, cost_seconds=0.001, copy_seconds=0.001)
    far = dict(near, seconds_until_next_use=0.05)
    assert core.filter_score("delta", far, 0) > core.filter_score("delta", near, 0)
    costly = dict(far, cost_seconds=0.01)
    assert core.filter_score("delta", far, 0) > core.filter_score("delta", costly, 0)
    assert core.filter_score("delta", dict(far, host_valid=True), 0) >= core.filter_score("delta", far, 0)


def test_delta_is_cost_per_byte_second(core):
    # Note [Delta score]: twice the bytes or twice the time until the next
    # use is worth twice the cost; the unpack count alone no longer matters.
    base = dict(bytes=MiB, seconds_until_next_use=0.01, cost_seconds=0.001)
    score = core.filter_score("delta", base, 0)
    assert core.filter_score("delta", dict(base, bytes=2 * MiB, cost_seconds=0.002), 0) == pytest.approx(score)
    longer = dict(base, seconds_until_next_use=0.02, cost_seconds=0.002)
    assert core.filter_score("delta", longer, 0) == pytest.approx(score, rel=1e-3)
    assert core.filter_score("delta", dict(base, next_use_distance=500), 0) == pytest.approx(score)


def test_delta_counts_the_evicted_neighbourhood(core):
    # Dropping next to dropped lineage neighbours chains their replays onto
    # its own (DTR's neighbourhood), so it goes later.
    alone = dict(bytes=MiB, seconds_until_next_use=0.01, cost_seconds=0.001)
    assert core.filter_score("delta", alone, 0) > core.filter_score("delta", dict(alone, neighbourhood_seconds=0.001), 0)


def test_delta_leaves_the_neighbourhood_out_of_a_host_backed_release(core):
    # Note [Host-backed victims]: released with a valid host copy, a victim
    # is not dropped and chains no neighbour's replay; priced with DTR's
    # neighbourhood, a free release ranked below a 1 ms drop.
    free = dict(bytes=MiB, seconds_until_next_use=0.01, cost_seconds=0.0, host_valid=True, swap_chosen=True,
                neighbourhood_seconds=0.005)
    drop = dict(bytes=MiB, seconds_until_next_use=0.01, cost_seconds=0.001)
    assert core.filter_score("delta", free, 0) > core.filter_score("delta", drop, 0)
    # Without a host copy the release may still end in a drop: the term stays.
    to_copy = dict(free, host_valid=False)
    assert core.filter_score("delta", to_copy, 0) < core.filter_score("delta", drop, 0)
    # dtr keeps DTR's score.
    assert core.filter_score("dtr", free, 10) < core.filter_score("dtr", drop, 10)


def test_delta_without_a_measured_pace_ranks_bytes_per_cost(core):
    # First iteration: no unpack pace measured, every horizon is 0.
    big_cheap = dict(bytes=4 * MiB, cost_seconds=0.001)
    small_costly = dict(bytes=MiB, cost_seconds=0.002)
    assert core.filter_score("delta", big_cheap, 0) > core.filter_score("delta", small_costly, 0) > 0


def test_neighbourhood_classes_merge_and_shrink(core):
    n = core.EvictedNeighbourhoods()
    n.add(1, 1.0, [])
    n.add(2, 2.0, [1])      # joins 1's class
    n.add(5, 4.0, [])
    assert n.cost_of([1]) == pytest.approx(3.0)
    assert n.cost_of([1, 2, 5]) == pytest.approx(7.0)  # each class once
    n.remove(2, 2.0)
    assert n.cost_of([1]) == pytest.approx(1.0)
    assert n.cost_of([7]) == 0.0


def test_copy_in_backlog_stall_is_the_largest_lateness(core):
    # Note [Copy-in backlog]. Over a 1 GB/s link, two entries on host of
    # 100 MB needed 0.15 s and 0.2 s after copy-ins start arrive at 0.1 s
    # and 0.2 s: in time. A third needed first (at 0.05 s, 100 MB) is late
    # by 0.05 s itself, and pushes the other two back by 0.1 s each: the one
    # needed at 0.15 s arrives at 0.2 s (0.05 s late), the last at 0.3 s
    # (0.1 s late). Backward waits once for the worst of them: 0.1 s, not
    # the 0.2 s sum of the three latenesses, and not the third's own 0.05 s.
    on_host = [(0.15, 100_000_000), (0.2, 100_000_000)]
    stall, added = core.copy_in_added_stall(on_host, 0, 1e9, 0.05, 100_000_000)
    assert stall == pytest.approx(0.0, abs=1e-12)
    assert added == pytest.approx(0.1)
    # Needed after both, with time to spare: hidden.
    assert core.copy_in_added_stall(on_host, 0, 1e9, 0.5, 100_000_000)[1] == pytest.approx(0.0, abs=1e-12)
    # Copies already on the link come first.
    stall, added = core.copy_in_added_stall(on_host, 50_000_000, 1e9, 0.5, 100_000_000)
    assert stall == pytest.approx(0.05) and added == pytest.approx(0.0, abs=1e-12)
    assert core.copy_in_added_stall([], 0, 1e9, 0.05, 100_000_000) == pytest.approx((0.0, 0.05))


def test_director_takes_the_copy_in_stall_from_the_backlog(core):
    # Needed 10 s away, the copy-in alone looks hidden; behind backward's
    # backlog it is not, and the replay wins.
    facts = dict(bytes=100 * MiB, recomputable=True, link_bytes_per_s=1e9, recompute_seconds=0.15,
                 seconds_until_next_use=10.0, host_valid=True)
    assert core.decide(facts)["action"] == "swap"
    late = core.decide(dict(facts, copy_in_stall_seconds=0.2))
    assert late["action"] == "recompute" and late["swap_stall_seconds"] == pytest.approx(0.2)
