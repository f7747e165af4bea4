"""What a rank says when the agreement on a new graph times out: the ranks that did not arrive,
never itself; and where the store is gone (it lives with rank 0's process), that it cannot say
which."""

from deepcompile.runtime.divergence import DivergenceChecks


class _Store:
    def __init__(self, keys=(), gone=False):
        self.keys, self.gone = set(keys), gone

    def check(self, keys):
        if self.gone:
            raise RuntimeError("Broken pipe")
        return all(k in self.keys for k in keys)


def _checks(rank, world, store):
    c = DivergenceChecks.__new__(DivergenceChecks)
    c.rank, c.world, c.store = rank, world, store
    c._wait_s = lambda: 2.0
    return c


def test_the_ranks_that_did_not_arrive_are_named_never_this_one():
    store = _Store({"graph/0/at/1", "graph/0/at/3"})
    assert _checks(1, 4, store)._absent("graph/0") == "ranks [0, 2] did not compile it within 2 s"


def test_a_store_that_is_gone_says_it_cannot_tell():
    msg = _checks(1, 2, _Store(gone=True))._absent("graph/0")
    assert msg.startswith("some rank did not compile it within 2 s")
    assert "the store cannot say" in msg and "Broken pipe" in msg
