"""What a module's declared attributes read as: the declaration outside a call, the call's tensor inside one (on the
thread that makes it, so two threads each see their own weights), an ordinary value where an instance set one under
a name others declared; and a declaration that would hide an attribute of the class is refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from psgd.autodiff import Tensor
from psgd.model import Linear, ModelError, Network, Parameter
from psgd.model.module import Module


class TwoLayers(Network):
    def __init__(self, dtype="float64"):
        super().__init__(dtype)
        self.with_bias = Linear(3, 2)
        self.without = Linear(2, 2, bias=False)

    def forward(self, x):
        return self.without(self.with_bias(x))


def test_a_parameter_reads_as_its_declaration_outside_a_call_and_as_the_calls_tensor_inside():
    net = TwoLayers()
    assert isinstance(net.with_bias.W, Parameter) and net.with_bias.W.shape == (3, 2)
    assert net.without.b is None  # an ordinary value under a name the other instance declared
    params = net.init(0)
    seen = {}

    def forward(x):
        seen["W"], seen["b"], seen["none"] = net.with_bias.W, net.with_bias.b, net.without.b
        return TwoLayers.forward(net, x)

    net.forward = forward
    net.loss_and_grads(params, np.ones((4, 3)), np.zeros(4, dtype=int))
    assert isinstance(seen["W"], Tensor) and seen["W"].data is params["with_bias/W"]
    assert isinstance(seen["b"], Tensor) and seen["none"] is None
    assert isinstance(net.with_bias.W, Parameter)  # the call is over


def test_two_threads_calling_one_network_each_see_their_own_weights():
    net = TwoLayers()
    first, second = net.init(0), net.init(1)
    x = np.random.default_rng(0).standard_normal((5, 3))
    alone = [net.predict(first, x), net.predict(second, x)]
    inside = threading.Barrier(2, timeout=10)

    class Slow(Linear):  # both threads are inside a call at once: each reads its W after the other bound its own
        def forward(self, x):
            inside.wait()
            return super().forward(x)

    net.with_bias = Slow(3, 2)
    got: dict[int, np.ndarray] = {}
    threads = [
        threading.Thread(target=lambda i=i, p=p: got.__setitem__(i, net.predict(p, x)))
        for i, p in enumerate((first, second))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)
    np.testing.assert_array_equal(got[0], alone[0])
    np.testing.assert_array_equal(got[1], alone[1])


def test_a_declaration_that_would_hide_an_attribute_of_the_class_is_refused():
    class Odd(Module):
        def forward(self, x):
            return x

        def scale(self):
            return 2

    odd = Odd()
    with pytest.raises(ModelError, match="cannot declare 'scale'"):
        odd.scale = Parameter((2,))
    assert odd.scale() == 2
    with pytest.raises(AttributeError, match="has no attribute 'gain'"):
        Odd().gain  # noqa: B018 - reading it is the test
    odd.gain = Parameter((2,))
    with pytest.raises(AttributeError, match="has no attribute 'gain'"):
        Odd().gain  # noqa: B018 - another instance of the class declared it, this one did not
