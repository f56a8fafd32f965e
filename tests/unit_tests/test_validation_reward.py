"""validation_reward/mean: the held-out set scored with the run's sampling and a fixed seed,
sharded over ranks and pooled by count (CPU, one gloo rank, a scripted engine)."""

import dataclasses
from types import SimpleNamespace

from megatron_rl_bi.distributed import all_reduce_metrics
from megatron_rl_bi.envs.environment import build_environment
from megatron_rl_bi.envs.tasks import JsonlTask, LookupTask
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.evaluate import validation_terms
from megatron_rl_bi.rl.conversations import TurnConfig
from megatron_rl_bi.rl.rollouts import RolloutConfig

from .conftest import ScriptedGenerator

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
    first = all_reduce_metrics(validation_terms(generator, examples, TOK, sampling, seed=5,
                                                        config=RolloutConfig()))
    again = all_reduce_metrics(validation_terms(generator, examples, TOK,
                                                dataclasses.replace(sampling, seed=999), seed=5,
                                                config=RolloutConfig()))
    assert first["validation_reward/mean"] == again["validation_reward/mean"] == 0.5
    assert generator.seeds == [5, 5]  # the fixed seed, whatever the step's sampling seed


class SearchesThenAnswers(ScriptedGenerator):
    """Searches for the key, then answers with the first number it read (every answer right)."""

    config = SimpleNamespace(max_sequence_length=256, max_prompt_tokens=255)

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for prompt in prompts:
            text = TOK.decode(prompt)
            turn = (f"<answer>{text.split(' is ')[1][:3]}</answer>" if "<information>" in text
                    else f"<search>{text.split()[1]}</search>")
            ids = TOK.encode(turn)
            out.append(Generation(list(prompt), ids, [-0.5] * len(ids)))
        return out


def test_validation_of_conversations_is_scored_by_the_environment(gloo_group):
    task = LookupTask(seed=0)
    config = RolloutConfig(environment=build_environment("search", task, search_top_k=1), turns=TurnConfig())
    examples = [task.example(i) for i in range(3)]
    examples.append(dataclasses.replace(examples[0], answer="000"))  # a wrong reference: scores 0
    metrics = all_reduce_metrics(validation_terms(SearchesThenAnswers(), examples, TOK,
                                                  Sampling(max_new_tokens=32, eod_id=TOK.eod), seed=1, config=config))
    assert metrics["validation_reward/mean"] == 0.75 and metrics["validation/reward_problems"] == 0
