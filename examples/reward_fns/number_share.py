"""A reward for sizing runs on random weights (`--rl-reward-fn
examples/reward_fns/number_share.py:number_share`): random weights never solve a problem, so
under DAPO every group's task rewards are equal, dynamic sampling drops every group and generates
again, and no step trains. The share of the completion's words that are numbers varies from one
sampled completion to the next, so groups keep a signal and each step trains on its rollouts, as a
step of a real run does."""


def number_share(prompt: str, completion: str, example) -> float:
    words = completion.split()
    return sum(word.isdigit() for word in words) / len(words) if words else 0.0
