"""The parity tools' request-size flags (config/parity_args.py) are checked before any GPU work: reversed ranges,
zero counts, a non-positive temperature and an output in a missing directory are named."""

import argparse

import pytest

from megatron_rl_bi.config.parity_args import check_parity_requests



def _args(**overrides):
    values = dict(parity_prompt_lengths=[1, 500], parity_max_new_tokens=[1, 256], parity_requests=32,
                  parity_orders=2, parity_temperature=1.0, max_position_embeddings=1024,
                  inference_max_seq_length=1024, parity_modes=["default"], parity_vocab_size=32000,
                  parity_micro_batch_tokens=8192, parity_output=None)
    return argparse.Namespace(**{**values, **overrides})


def test_good_sizes_pass():
    check_parity_requests(_args())


def test_bad_sizes_are_each_named():
    with pytest.raises(ValueError) as info:
        check_parity_requests(_args(parity_prompt_lengths=[900, 1], parity_max_new_tokens=[0, 4],
                                               parity_requests=0, parity_orders=0, parity_temperature=0.0,
                                               parity_vocab_size=0, parity_micro_batch_tokens=0,
                                               parity_output="/nowhere/parity.json"))
    message = str(info.value)
    for expected in ("--parity-prompt-lengths 900 1: give 1 <= MIN <= MAX",
                     "--parity-max-new-tokens 0 4: give 1 <= MIN <= MAX", "--parity-requests must be >= 1",
                     "--parity-orders must be >= 1", "--parity-temperature must be > 0",
                     "--parity-vocab-size must be >= 1", "--parity-micro-batch-tokens must be >= 1",
                     "--parity-output /nowhere/parity.json: its directory does not exist"):
        assert expected in message


def test_requests_longer_than_the_model_are_refused():
    with pytest.raises(ValueError, match="allow 1256 tokens but --max-position-embeddings is 1024"):
        check_parity_requests(_args(parity_prompt_lengths=[1, 1000]))
