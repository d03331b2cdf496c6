import torch

from mtrain.config import ModelConfig
from mtrain.decode import greedy, length_limits
from mtrain.model import Transformer
from mtrain.tokenizer import BOS_ID, EOS_ID, PAD_ID


def model_that_copies(steps=300) -> Transformer:
    """Train a small model to copy its source: greedy decoding must then reproduce it."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=64, n_heads=4, n_encoder_layers=1, n_decoder_layers=1, d_ff=128, dropout=0.0
    )
    model = Transformer(cfg, 20, 20, max_len=16, pad_id=PAD_ID)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        body = torch.randint(4, 20, (32, 5), generator=g)
        src = torch.cat([body, torch.full((32, 1), EOS_ID)], 1)
        tgt_in = torch.cat([torch.full((32, 1), BOS_ID), body], 1)
        loss = torch.nn.functional.cross_entropy(model(src, tgt_in).flatten(0, 1), src.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_greedy_copies_and_stops_at_eos():
    model = model_that_copies()
    src = torch.tensor([[5, 9, 12, 7, 19, EOS_ID], [6, 6, 8, 4, 11, EOS_ID]])
    out = greedy(model, src, torch.tensor([10, 10]))
    assert out == [[5, 9, 12, 7, 19], [6, 6, 8, 4, 11]]


def test_length_limit_is_respected():
    model = model_that_copies(steps=1)
    src = torch.tensor([[5, 9, EOS_ID, PAD_ID], [6, 6, 8, EOS_ID]])
    out = greedy(model, src, torch.tensor([2, 4]))
    assert len(out[0]) <= 2 and len(out[1]) <= 4


def test_length_limits():
    src = torch.tensor([[5, 9, EOS_ID, PAD_ID], [6, 6, 8, EOS_ID]])
    assert length_limits(src, 2.0, cap=15).tolist() == [15, 15]
    assert length_limits(src, 1.0, cap=100).tolist() == [13, 14]
