"""An agent for novarl's endpoint (README: "Agents over an OpenAI-compatible endpoint"): it asks the
model, and when the answer is wrong asks once more, keeping the conversation; the reward is 1 for a
right answer. Written against the `openai` client, as an agent for any OpenAI-compatible server is.

    novarl train env.agent.agent=examples/agents/ask_twice.py:solve grpo.max_rollout_turns=2 \
        policy.max_seq_length=48 grpo.num_prompts_per_step=8 policy.train_micro_batch_size=64
"""


def solve(client, example) -> float:  # example: the data row ("prompt", "answer", its other fields)
    messages = [{"role": "user", "content": example["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        if example["answer"] in (reply.content or ""):
            return 1.0
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": " wrong, again:"}]
    return 0.0
