"""validation_reward/mean: the held-out set scored with the run's sampling and a fixed seed,
sharded over ranks and pooled by count (CPU, one gloo rank, a scripted engine)."""

import dataclasses

from megatron_rl_bi.distributed import all_reduce_metrics
from megatron_rl_bi.envs.tasks import JsonlTask
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.evaluate import validation_terms

TOK = CharTokenizer()


class EchoAnswers:
    """Answers '1 + 1' with 2 (right) and everything else with 0; records the seeds."""

    def __init__(self):
        self.seeds = []

    def generate(self, prompts, sampling, max_new_tokens=None):
        self.seeds.append(sampling.seed)
        return [Generation(list(p), TOK.encode("2" if TOK.decode(p) == "1 + 1" else "0") + [TOK.eod],
                           [-0.5, -0.5], stopped_on_eod=True) for p in prompts]


def test_validation_reward(tmp_path, gloo_group):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt": "1 + 1", "answer": "2"}\n{"prompt": "2 + 2", "answer": "4"}\n'
                    '{"prompt": "0 + 0", "answer": "0"}\n{"prompt": "3 + 3", "answer": "6"}\n')
    generator, sampling = EchoAnswers(), Sampling(max_new_tokens=4, eod_id=TOK.eod, seed=77)
    examples = JsonlTask(str(path)).examples
    first = all_reduce_metrics(validation_terms(generator, examples, TOK, sampling, seed=5))
    again = all_reduce_metrics(validation_terms(generator, examples, TOK,
                                                dataclasses.replace(sampling, seed=999), seed=5))
    assert first["validation_reward/mean"] == again["validation_reward/mean"] == 0.5
    assert generator.seeds == [5, 5]  # the fixed seed, whatever the step's sampling seed
