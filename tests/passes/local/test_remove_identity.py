import torch
from torch import nn

import distopt


def test_identity_modules_disappear_from_generated_code() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.ReLU(), nn.Identity())
    gm = distopt.optimize(
        model,
        (torch.randn(2, 4),),
        passes=["remove_identity"],
        config={"measure": {"enabled": False}},
    )
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "2"]
    # state_dict keys (none for Identity) and the outputs are unchanged.
    assert list(gm.state_dict()) == list(model.state_dict())


def test_dropout_is_kept_even_in_eval_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    gm = distopt.optimize(
        model,
        (torch.randn(2, 4),),
        passes=["remove_identity"],
        config={"measure": {"enabled": False}},
    )
    assert "1" in [n.target for n in gm.graph.nodes if n.op == "call_module"]
