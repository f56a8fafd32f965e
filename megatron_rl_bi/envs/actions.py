"""What a tool environment answers to a turn that took none of its actions (neither a tool call
nor an answer): as Search-R1's environment does, it says so and the conversation goes on, so a
malformed turn costs a turn of the budget instead of ending the sample. Without this a model
that has not yet learned the tags (random weights, early RL) never reaches a second turn."""


def no_action_observation(actions: tuple[str, ...]) -> str:
    """The observation after a turn with none of `actions` (e.g. "<search>query</search>")."""
    return f"\nThe last turn took no action. Write one of: {' or '.join(actions)}.\n"
