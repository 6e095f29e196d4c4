"""A realistic shared-prefix chat workload for an instruct model (``radixkv demo`` on
SmolLM2-135M-Instruct, bench/bench_real_model.py and the notebooks).

One deployment of an assistant: every request starts with the same system prompt and the same
few-shot exchanges (how the assistant should answer), then a user's question; a few users hold
multi-turn conversations, each turn resending the conversation so far. The texts are fixed (no
randomness), so the prompts are the same on every run and every system a benchmark compares.

* `shared_prefix_messages` : the system prompt and ``num_examples`` few-shot exchanges;
* `QUESTIONS`              : one-shot questions asked after that shared prefix;
* `CONVERSATIONS`          : multi-turn conversations (user turns; the assistant's turns are
  what the model answers);
* `UNRELATED`              : prompts that share nothing (each its own system prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SYSTEM_PROMPT = (
    "You are Sol, the assistant of an online learning site for adults. Learners ask short "
    "questions about science, history, geography, cooking, health, money, language and "
    "programming. Follow these rules in every answer:\n"
    "1. Answer the question directly in the first sentence.\n"
    "2. Use at most three short sentences, unless the learner asks for more.\n"
    "3. Use plain words; explain any technical term the first time you use it.\n"
    "4. When the question is about code, answer with a short Python example.\n"
    "5. If you are not sure, say so instead of guessing.\n"
    "6. Be friendly and encouraging, but do not add greetings or sign-offs.\n"
    "Here are examples of good answers."
)

# (user, assistant) pairs: the few-shot part of the shared prefix
EXAMPLES: tuple[tuple[str, str], ...] = (
    (
        "Why is the sky blue?",
        "The sky looks blue because air scatters blue sunlight more than red sunlight. "
        "Sunlight contains all colours, and the short blue waves bounce off air molecules in "
        "every direction. At sunset the light crosses more air, so the blue is scattered away "
        "and the sky turns orange.",
    ),
    (
        "How do I make a boiled egg with a soft yolk?",
        "Lower the egg into boiling water and cook it for six minutes. Then put it in cold "
        "water for one minute so it stops cooking and is easy to peel.",
    ),
    (
        "What does a Python list comprehension look like?",
        "A list comprehension builds a list from another sequence in one line:\n\n"
        "```python\nsquares = [n * n for n in range(5)]\nprint(squares)  # [0, 1, 4, 9, 16]\n"
        "```\n\nRead it as: for each n in range(5), put n * n in the list.",
    ),
    (
        "Who built the pyramids of Giza?",
        "The pyramids of Giza were built by the ancient Egyptians about 4,500 years ago. "
        "They were tombs for the pharaohs Khufu, Khafre and Menkaure. Paid workers, not slaves, "
        "did most of the building.",
    ),
    (
        "What is compound interest?",
        "Compound interest is interest that is also paid on earlier interest. If you save 100 "
        "dollars at 5 percent a year, you have 105 dollars after one year and 110.25 after two, "
        "because the second year pays interest on 105.",
    ),
    (
        "How many hours of sleep does an adult need?",
        "Most adults need seven to nine hours of sleep a night. Less than that, night after "
        "night, makes it harder to concentrate and to fight infections.",
    ),
    (
        "What is the difference between weather and climate?",
        "Weather is what the air is doing today: rain, sun, wind or snow. Climate is the "
        "average weather of a place over thirty years or more. A cold day does not change the "
        "climate, but many warm years do.",
    ),
    (
        "How do I read a file line by line in Python?",
        "Open the file with a with statement and loop over it:\n\n```python\nwith "
        "open('notes.txt') as f:\n    for line in f:\n        print(line.rstrip())\n```\n\n"
        "The with statement closes the file for you when the loop ends.",
    ),
    (
        "What is the capital of Australia?",
        "The capital of Australia is Canberra. Many people guess Sydney, which is the largest "
        "city, but Canberra was built as a compromise between Sydney and Melbourne.",
    ),
    (
        "Why do onions make you cry?",
        "Cutting an onion breaks its cells and releases a gas called syn-propanethial-S-oxide. "
        "When the gas reaches your eyes it irritates them, and they make tears to wash it away. "
        "A sharp knife and a cold onion release less of it.",
    ),
    (
        "What is a noun?",
        "A noun is a word that names a person, place, thing or idea. In the sentence 'The "
        "teacher opened the window', both teacher and window are nouns.",
    ),
    (
        "How does a vaccine work?",
        "A vaccine trains your immune system with a harmless piece or copy of a germ. Your body "
        "learns to recognise it and makes antibodies. If the real germ arrives later, your body "
        "fights it off quickly.",
    ),
)

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Why do leaves change colour in autumn?",
    "How do I cook rice on the stove?",
    "What is photosynthesis?",
    "Who was Marie Curie?",
    "What is the largest planet in the solar system?",
    "How do I sort a list of numbers in Python?",
    "What causes earthquakes?",
    "What is inflation?",
    "How can I drink more water during the day?",
    "What is the difference between a virus and a bacterium?",
    "Why is the ocean salty?",
    "What is a verb?",
    "How do I make a simple salad dressing?",
    "What is the speed of light?",
    "Who wrote Romeo and Juliet?",
    "How do I check if a number is even in Python?",
    "What is gravity?",
    "How long should I boil pasta?",
    "What is the longest river in the world?",
    "What is a budget, and why should I make one?",
    "How do bees make honey?",
    "What is a dictionary in Python?",
    "Why do we have seasons?",
    "What is the Great Wall of China?",
    "How do I stay focused while studying?",
    "What is an atom?",
    "How do I count the words in a sentence with Python?",
    "What is the tallest mountain on Earth?",
    "Why should I stretch before exercise?",
    "What is democracy?",
)

# Each conversation: the user's turns, in order (the assistant answers each in between).
CONVERSATIONS: tuple[tuple[str, ...], ...] = (
    (
        "I want to start running. How should I begin?",
        "How often should I run in the first month?",
        "What should I eat before a run?",
        "Thanks! Can you sum up your advice in one sentence?",
    ),
    (
        "What is a variable in Python?",
        "Can you show me an example with a number and a string?",
        "How do I change the value of a variable?",
        "What happens if I use a variable before giving it a value?",
    ),
    (
        "I am visiting Japan in spring. What should I see?",
        "What food should I try there?",
        "How do I say thank you in Japanese?",
        "Is it polite to tip in restaurants there?",
    ),
    (
        "How do plants drink water?",
        "What happens if a plant gets too much water?",
        "How often should I water a cactus?",
        "Which plants are easy for beginners?",
    ),
    (
        "What was the Roman Empire?",
        "Who was Julius Caesar?",
        "Why did the Western Roman Empire fall?",
        "What did the Romans leave behind that we still use?",
    ),
    (
        "How do I save money on groceries?",
        "Is it cheaper to cook at home than to eat out?",
        "What are some cheap and healthy meals?",
        "How much should I spend on food each week?",
    ),
    (
        "What is a for loop in Python?",
        "How do I loop over a list of names?",
        "How do I stop a loop early?",
        "What is the difference between a for loop and a while loop?",
    ),
    (
        "Why is exercise good for the brain?",
        "How much exercise do adults need each week?",
        "Does walking count as exercise?",
        "What is a good exercise to do at my desk?",
    ),
    (
        "What is the moon made of?",
        "Why does the moon change shape during the month?",
        "How far away is the moon?",
        "Who was the first person to walk on the moon?",
    ),
    (
        "How do I bake bread at home?",
        "What does yeast do in bread?",
        "Why did my bread come out flat?",
        "Can I make bread without yeast?",
    ),
    (
        "What is electricity?",
        "What is the difference between AC and DC?",
        "Why do birds on power lines not get hurt?",
        "How can I save electricity at home?",
    ),
    (
        "I want to learn Spanish. Where should I start?",
        "How do I say good morning in Spanish?",
        "How many words do I need to hold a simple conversation?",
        "How long does it take to learn Spanish?",
    ),
    (
        "What is a function in Python?",
        "Can you write a function that adds two numbers?",
        "What does the return statement do?",
        "Can a function return two values?",
    ),
    (
        "What is a volcano?",
        "Why do volcanoes erupt?",
        "Which volcano destroyed Pompeii?",
        "Can scientists predict eruptions?",
    ),
    (
        "What is a credit score?",
        "How can I improve my credit score?",
        "Does checking my own score lower it?",
        "How long does a late payment stay on my record?",
    ),
    (
        "Why do cats purr?",
        "Why do cats knock things off tables?",
        "How much should an adult cat sleep?",
        "How can I tell if my cat is happy?",
    ),
)

# (system prompt, user message): prompts of different deployments, sharing nothing
UNRELATED: tuple[tuple[str, str], ...] = (
    ("You are a travel agent.", "Plan a weekend in Rome for two people."),
    ("You are a chef.", "Give me a recipe for tomato soup."),
    ("You are a math tutor.", "Explain what a prime number is."),
    ("You are a fitness coach.", "Suggest a ten-minute morning workout."),
    ("You write short poems.", "Write a poem about the sea."),
    ("You are a history teacher.", "Why did the First World War start?"),
    ("You are a career adviser.", "How do I write a good cover letter?"),
    ("You are a gardener.", "When should I plant tomatoes?"),
    ("You are a Python expert.", "Explain what a Python decorator does."),
    ("You are a doctor.", "What are the symptoms of a cold?"),
    ("You are a librarian.", "Recommend three classic novels."),
    ("You are an astronomer.", "What is a black hole?"),
    ("You are a bank clerk.", "What is the difference between a debit and a credit card?"),
    ("You are a music teacher.", "How do I start learning the guitar?"),
    ("You are a pet trainer.", "How do I teach my dog to sit?"),
    ("You are a chemistry teacher.", "What is the difference between an acid and a base?"),
    ("You are a storyteller.", "Tell me a short story about a brave mouse."),
    ("You are a geography teacher.", "Name the seven continents."),
    ("You are an English teacher.", "When do I use 'their', 'there' and 'they're'?"),
    ("You are a nutritionist.", "Is breakfast the most important meal of the day?"),
    ("You are an IT support agent.", "My laptop is slow. What can I do?"),
    ("You are a carpenter.", "How do I hang a shelf on a wall?"),
    ("You are a physics teacher.", "Why do things float in water?"),
    ("You are a sleep coach.", "How can I fall asleep faster?"),
    ("You are an art teacher.", "What are the primary colours?"),
    ("You are a biologist.", "How do birds know where to migrate?"),
    ("You are a SQL expert.", "Write a query that counts the rows of a table named users."),
    ("You are a philosopher.", "What is the meaning of happiness?"),
    ("You are an economist.", "Why do prices go up over time?"),
    ("You are a mechanic.", "How often should I change my car's oil?"),
    ("You are a meteorologist.", "How do clouds form?"),
    ("You are a language tutor.", "How do I say hello in French, German and Italian?"),
)


def shared_prefix_messages(num_examples: int = len(EXAMPLES)) -> list[dict[str, Any]]:
    """The system prompt and the first ``num_examples`` few-shot exchanges, as chat messages:
    the prefix every question and conversation of this workload starts with."""
    if not 0 <= num_examples <= len(EXAMPLES):
        raise ValueError(f"num_examples must be in [0, {len(EXAMPLES)}], got {num_examples}")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    for user, assistant in EXAMPLES[:num_examples]:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return msgs


def question_messages(question: str, num_examples: int = len(EXAMPLES)) -> list[dict[str, Any]]:
    """One question after the shared prefix."""
    return [*shared_prefix_messages(num_examples), {"role": "user", "content": question}]


def conversation_messages(
    user_turns: Sequence[str], answers: Sequence[str], num_examples: int = len(EXAMPLES)
) -> list[dict[str, Any]]:
    """A conversation after the shared prefix: the user turns with the assistant's ``answers``
    in between (one answer fewer than user turns: the last turn is the one to answer)."""
    if len(answers) != len(user_turns) - 1:
        raise ValueError(
            f"{len(user_turns)} user turns need {len(user_turns) - 1} answers, got {len(answers)}"
        )
    msgs = shared_prefix_messages(num_examples)
    for i, user in enumerate(user_turns):
        msgs.append({"role": "user", "content": user})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def unrelated_messages(index: int) -> list[dict[str, Any]]:
    """The ``index``-th prompt of `UNRELATED` as chat messages (its own system prompt)."""
    system, user = UNRELATED[index]
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
