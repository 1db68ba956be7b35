"""A promotion-gate evaluation set for the tiny model, and the rewards of a helpful and a harmful step.

The users of the gate tests liked the initial model's answers to QUESTIONS: the scorer gives an
answer 1 when it is the one they liked (REFERENCE, filled by :func:`fill_reference` with the initial
model's greedy answers), else 0. ``reward`` is what those users' reactions say (+1); ``flipped_reward`` is
the same reward with its sign flipped (-1), a deliberately harmful learning signal; ``session_reward`` is
the harmful one for the turns of sessions named ``harm-...`` only.
"""

EVALUATOR = "tests.utils.gate_eval:evaluator"

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What do bees make?", "Why is the sky blue?"]
REFERENCE: dict[int, str] = {}


def evaluator(*, size: int, seed: int):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[:size]]
    return prompts, lambda i, answer: float(answer == REFERENCE[i])


async def reward(*, turn, next_state):
    return 1, None


async def flipped_reward(*, turn, next_state):
    return -1, None


async def session_reward(*, turn, next_state):
    return (-1 if turn.session_id.startswith("harm-") else 1), None


def fill_reference(model_dir) -> None:
    """The initial model's greedy answers to the evaluation prompts: the answers the users liked."""
    from clawrl import runtime
    from clawrl.chat import ChatAdapter
    from clawrl.engine.embedded import EmbeddedEngine
    from clawrl.evaluation import answer_prompts, load_eval_set

    engine = EmbeddedEngine(model_dir, max_batch_size=8, max_context_len=1024)
    eval_set = load_eval_set(EVALUATOR, size=4, samples=2, seed=0, max_tokens=8, temperature=0.0)
    answers = runtime.run(answer_prompts(engine, ChatAdapter(engine.tokenizer), eval_set))
    runtime.run(engine.close())
    REFERENCE.update({i: a[0] for i, a in enumerate(answers)})


def rate(messages, answer):
    """A replay set's ``[gate] evaluator``: 1 for an answer with any text in it."""
    return float(bool(answer.strip()))
