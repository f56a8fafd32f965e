"""Which tensors wait on the host while the engine generates (rl/optimizer_offload.py), on CPU:
each inner optimizer's parameters and the tensors of their state, as megatron-core's
offload_to_cpu moves them; the round trip itself is a GPU test (tests/gpu/test_memory_levers.py)."""

import torch

from megatron_rl_bi.rl.optimizer_offload import optimizer_tensor_slots, optimizer_tensors


class _Inner:
    def __init__(self, optimizer, stub=False):
        self.optimizer, self.is_stub_optimizer = optimizer, stub


def _adam(*sizes) -> torch.optim.Adam:
    params = [torch.nn.Parameter(torch.ones(n)) for n in sizes]
    adam = torch.optim.Adam(params)
    for param in params:
        param.grad = torch.ones(param.shape)
    adam.step()
    return adam


def test_the_slots_are_each_inner_optimizers_parameters_and_state_tensors():
    first, second = _adam(3, 5), _adam(7)
    first.state[first.param_groups[0]["params"][0]]["note"] = "not a tensor"
    chained = type("Chained", (), {})()
    chained.chained_optimizers = [_Inner(first), _Inner(_adam(11), stub=True), _Inner(second)]
    slots = optimizer_tensor_slots(chained)
    params = first.param_groups[0]["params"] + second.param_groups[0]["params"]
    assert [holder for holder, key in slots if key is None] == params
    state_keys = [key for holder, key in slots if key is not None]
    assert state_keys == ["step", "exp_avg", "exp_avg_sq"] * 3
    assert [holder for holder, key in slots if key == "exp_avg"] == [first.state[p] for p in params[:2]] + \
        [second.state[params[2]]]


def test_a_plain_optimizer_is_its_own_inner_one():
    adam = _adam(4)
    assert len(optimizer_tensor_slots(_Inner(adam))) == 1 + 3
    param = adam.param_groups[0]["params"][0]
    state = adam.state[param]
    tensors = optimizer_tensors(_Inner(adam))
    assert tensors[0].data_ptr() == param.data_ptr()  # .data is a new view of the parameter's storage
    assert all(got is state[key] for got, key in zip(tensors[1:], ("step", "exp_avg", "exp_avg_sq")))


def test_shards_of_a_buffer_the_weights_share_stay_where_they_are():
    # --optimizer-cpu-offload: megatron-core's distributed optimizer hands its inner optimizer
    # views of DDP's parameter buffer (model_param.detach().view(-1)[start:end]), which the model's
    # weights are views of too; its own state lives on the CPU.
    buffer = torch.zeros(10)
    weights = [torch.nn.Parameter(torch.empty(4)), torch.nn.Parameter(torch.empty(6))]
    weights[0].data, weights[1].data = buffer[:4], buffer[4:]
    shards = [weight.detach().view(-1)[1:] for weight in weights]
    owned = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([{"params": shards}, {"params": [owned]}])
    adam.state[owned]["exp_avg"] = torch.zeros(3)
    adam.state[owned]["a_view"] = buffer[:2]
    assert optimizer_tensor_slots(_Inner(adam)) == [(owned, None), (adam.state[owned], "exp_avg")]
