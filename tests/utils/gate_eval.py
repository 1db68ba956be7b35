"""A promotion-gate evaluation set for the tiny model, and the rewards of a helpful and a harmful step.

The users of the gate tests liked the initial model's answers to QUESTIONS: the scorer gives an
answer 1 when it is the one they liked (REFERENCE, filled by the test with the initial model's
greedy answers), else 0. ``reward`` is what those users' reactions say (+1); ``flipped_reward`` is
the same reward with its sign flipped (-1), a deliberately harmful learning signal.
"""

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What do bees make?", "Why is the sky blue?"]
REFERENCE: dict[int, str] = {}


def evaluator(*, size: int, seed: int):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[:size]]
    return prompts, lambda i, answer: float(answer == REFERENCE[i])


async def reward(*, turn, next_state):
    return 1, None


async def flipped_reward(*, turn, next_state):
    return -1, None


def rate(messages, answer):
    """A replay set's ``[gate] evaluator``: 1 for an answer with any text in it."""
    return float(bool(answer.strip()))
