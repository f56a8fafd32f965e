"""Weight versions kept on the CPU (--rl-keep-old-weights): only the newest N, swapped in for a
block and the module's own weights back after, bit for bit."""

import torch

from megatron_rl_bi.rl.old_weights import KeptWeights


def test_the_newest_versions_are_kept_and_swapped_in_and_out_exactly():
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    kept = KeptWeights(2)
    snapshots = {}
    for version in range(4):
        kept.keep(version, module)
        snapshots[version] = {k: v.clone() for k, v in module.state_dict().items()}
        with torch.no_grad():
            module.weight.add_(1.0)
    assert list(kept.versions) == [2, 3]  # the newest two
    current = {k: v.clone() for k, v in module.state_dict().items()}
    with kept.swapped_in(module, 2):
        assert all(torch.equal(module.state_dict()[k], v) for k, v in snapshots[2].items())
    assert all(torch.equal(module.state_dict()[k], v) for k, v in current.items())
    assert not KeptWeights(0).versions and KeptWeights(0).keep(0, module) is None
