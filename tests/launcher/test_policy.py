"""The launcher's policy, derived from each kind's own facts (launcher/policy.py)."""

import pytest

from tfdist.launcher import policy
from tfdist.strategies import ConfigError, kinds
from tfdist.strategies.kinds import StrategyKind

PS, SYNC_PS, MW = kinds.get("ps"), kinds.get("ps-sync"), kinds.get("multiworker")


def test_layout_per_kind():
    assert policy.layout(PS, 2, 1) == {"chief": 1, "worker": 2, "ps": 1}
    assert policy.layout(SYNC_PS, 2, 1) == {"chief": 1, "worker": 2, "ps": 1}
    assert policy.layout(MW, 3) == {"chief": 0, "worker": 3, "ps": 0}
    assert policy.layout(MW, 2, chief=True) == {"chief": 1, "worker": 2, "ps": 0}
    assert policy.layout(kinds.get("mirrored"), 1) == {}
    assert policy.layout(kinds.get("none"), 1) == {}


@pytest.mark.parametrize("kind,args,words", [
    (PS, (2, 0), "needs --ps >= 1"),
    (PS, (2, policy.MAX_PS + 1), f"at most {policy.MAX_PS} ps tasks"),
    (MW, (2, 1), "takes no ps tasks"),
    (MW, (0,), "at least 1 worker"),
    (kinds.get("mirrored"), (2,), "is one process"),
])
def test_layout_rejects(kind, args, words):
    with pytest.raises(ConfigError, match=words):
        policy.layout(kind, *args)


def test_only_non_serving_tasks_decide():
    assert policy.decides(PS, "chief:0") and not policy.decides(PS, "worker:1")
    assert not policy.decides(PS, "ps:0")
    assert policy.decides(MW, "worker:1") and policy.decides(MW, "chief:0")
    assert policy.decides(kinds.get("mirrored"), "local:0")


def test_survivable_faults_per_kind():
    mirrored = policy.survivable_faults(kinds.get("mirrored"))
    assert set(mirrored) == {("kill", "local:0"), ("preempt", "local:0"), ("hang", "local:0")}
    assert ("kill", "ps:0") in policy.survivable_faults(PS)
    assert set(policy.survivable_faults(SYNC_PS)) == {
        ("kill", "worker:1"), ("preempt", "chief:0"), ("kill", "ps:0"),
        ("hang", "worker:0"), ("hang", "worker:1")}
    assert ("preempt", "worker:0") in policy.survivable_faults(MW)
    assert all(task.partition(":")[0] == "worker" for _, task in policy.survivable_faults(MW))


def test_hangs_for_every_computing_task_partitions_only_where_measured():
    for kind in (PS, SYNC_PS, MW):
        hung = {t for a, t in policy.survivable_faults(kind) if a == "hang"}
        assert hung == {"worker:0", "worker:1"}, kind
    # A partition needs simulated hosts, and is drawn only for the asynchronous
    # kind (the one docs/reliability.md measured surviving it).
    assert ("partition", "worker:1") in policy.survivable_faults(PS, hosts=True)
    assert not any(a == "partition" for a, _ in policy.survivable_faults(PS))
    for kind in (SYNC_PS, MW, kinds.get("mirrored")):
        assert not any(a == "partition" for a, _ in policy.survivable_faults(kind, hosts=True))
    # Bounded, and below the coordination service's 10 s heartbeat timeout.
    assert 0 < policy.HANG_SECONDS[0] <= policy.HANG_SECONDS[1] < 10
    assert set(policy.LASTING_SECONDS) == {"hang", "partition"}


def test_every_named_task_exists_in_the_soak_layout():
    # The soak runs --workers 2 --ps min_ps (one process when single): each
    # fault must name one of its tasks.
    for kind in kinds.all_kinds().values():
        tasks = set(policy.soak_tasks(kind))
        for action, task in policy.survivable_faults(kind, hosts=True):
            assert action in ("kill", "preempt", "hang", "partition") and task in tasks, (kind, task)


def test_a_new_kind_gets_its_policy_from_its_facts():
    class Coordinated(StrategyKind):
        name = "coordinated"
        computing_roles = ("worker",)
        serving_roles = ("worker", "ps")
        min_ps = 2

    kind = Coordinated()
    assert policy.layout(kind, 1, 2) == {"chief": 1, "worker": 1, "ps": 2}
    assert policy.has_coordinator(kind) and not policy.decides(kind, "worker:0")
    assert policy.survivable_faults(kind)[0] == ("kill", "worker:0")
