"""An environment for novarl's episodes (README: "Environments and multi-turn episodes"): the model
answers, and is told to try again until it is right or has used its tries.

    novarl train env.guess.actor_class_fqn=examples/environments/guess.py:Guess \
        'env.guess.cfg={tries: 3}' grpo.max_rollout_turns=3 policy.max_seq_length=48
"""

from novarl.rollout.environment import EnvStep


class Guess:
    def __init__(self, cfg):  # env.<name>.cfg
        self.tries = int(cfg.get("tries", 3))

    def step(self, conversation, metadata):  # metadata: the data row's fields, and its "answer"
        turns = sum(message["role"] == "assistant" for message in conversation)
        if metadata["answer"] in conversation[-1]["content"]:
            return EnvStep(reward=1.0, done=True)
        if turns == self.tries:
            return EnvStep(reward=0.0, done=True)
        return EnvStep(reward=0.0, done=False, observation={"role": "user", "content": " wrong, again:"})
