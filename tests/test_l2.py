import pytest
import torch

from sift.bench import _l2


@pytest.mark.parametrize("nbytes", [-1, 129, 32.0, True, "32"], ids=["negative", "over-128", "float", "bool", "str"])
def test_bad_fetch_granularity_is_rejected_before_touching_the_device(nbytes):
    with pytest.raises(ValueError, match="nbytes"):
        _l2.set_l2_fetch_granularity(nbytes)


def test_non_cuda_device_is_named():
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        _l2.get_l2_fetch_granularity("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_the_error_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        _l2.get_l2_fetch_granularity()


@pytest.mark.gpu
def test_fetch_granularity_is_set_inside_the_block_and_restored_after():
    before = _l2.get_l2_fetch_granularity()
    assert 0 <= before <= 128
    target = 32 if before != 32 else 128
    with _l2.l2_fetch_granularity(target) as inside:
        assert 0 <= inside <= 128  # a hint: the driver may clamp it
        g = torch.randn(1 << 22)
        idx = torch.randperm(g.numel())[: 1 << 12].sort().values
        assert torch.equal(g.cuda()[idx.cuda()].cpu(), g[idx])  # gathers stay exact under the bound
    assert _l2.get_l2_fetch_granularity() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given without CUDA")
def test_unavailable_says_why_without_cuda():
    why = _l2.l2_fetch_granularity_unavailable()
    assert why is not None and "CUDA" in why


@pytest.mark.gpu
def test_available_on_a_cuda_machine():
    assert _l2.l2_fetch_granularity_unavailable() is None
