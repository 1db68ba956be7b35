"""Questions the simulated users ask, each with the keywords an on-topic answer mentions.

Split deterministically into a training pool (what users ask while the model learns) and held-out
prompts (the evaluation after each step): the score is measured only on questions never trained on.
"""

from __future__ import annotations

import random

QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is photosynthesis?", ("light", "plant", "sun", "energy", "chlorophyll", "sugar", "glucose", "carbon")),
    ("Why is the sky blue?", ("light", "scatter", "wavelength", "blue", "atmospher", "sun")),
    ("How do vaccines work?", ("immune", "antibod", "virus", "body", "infection", "protect")),
    ("What causes rain?", ("water", "cloud", "vapor", "vapour", "condens", "droplet")),
    ("What is gravity?", ("force", "mass", "attract", "pull", "earth", "object")),
    ("How does a refrigerator keep food cold?", ("heat", "refrigerant", "cool", "compress", "temperature", "cold")),
    ("What is the capital of France?", ("paris",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the boiling point of water?", ("100", "212", "degree", "celsius", "fahrenheit")),
    ("How many continents are there?", ("seven", "7", "continent")),
    ("What do bees make?", ("honey", "wax")),
    ("What is the main gas in the air we breathe?", ("nitrogen", "oxygen")),
    ("Why do we have seasons?", ("tilt", "axis", "earth", "sun", "orbit")),
    ("What is a prime number?", ("divis", "itself", "factor", "number")),
    ("How does the heart pump blood?", ("heart", "blood", "muscle", "ventric", "atri", "vein", "arter", "pump")),
    ("What is DNA?", ("genetic", "gene", "molecule", "cell", "heredit", "acid")),
    ("What is the speed of light?", ("300", "299", "186", "second", "fast", "kilomet", "meter", "mile")),
    ("What is an atom?", ("proton", "neutron", "electron", "matter", "nucleus", "particle", "element")),
    ("How do plants drink water?", ("root", "xylem", "water", "soil", "leaves", "absorb")),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("What is the chemical symbol for gold?", ("au",)),
    ("Why do leaves change color in autumn?", ("chlorophyll", "pigment", "green", "yellow", "red", "sun", "fall", "autumn")),
    ("How does a rainbow form?", ("light", "refract", "droplet", "rain", "color", "colour", "sun")),
    ("What is the function of the lungs?", ("oxygen", "breath", "air", "carbon", "blood")),
    ("What is inflation in economics?", ("price", "money", "rise", "increase", "purchas", "value")),
    ("What is a black hole?", ("gravity", "light", "escape", "star", "mass", "space")),
    ("How do magnets work?", ("magnetic", "field", "pole", "attract", "iron", "electron")),
    ("What is the Moon made of?", ("rock", "dust", "mineral", "crust", "iron", "basalt")),
    ("Why is the ocean salty?", ("salt", "mineral", "river", "rock", "sodium")),
    ("What is the purpose of sleep?", ("rest", "brain", "memory", "body", "recover", "repair", "energy")),
    ("How do airplanes stay in the air?", ("lift", "wing", "air", "pressure", "thrust")),
    ("What is recycling?", ("reuse", "waste", "material", "new", "process")),
    ("What is a volcano?", ("magma", "lava", "erupt", "mountain", "earth")),
    ("What does a computer's CPU do?", ("process", "instruction", "calculat", "comput", "execut", "program")),
    ("What is the internet?", ("network", "computer", "connect", "global", "information")),
    ("Why do cats purr?", ("content", "happy", "communicat", "vibrat", "heal", "comfort", "cat")),
    ("What is the water cycle?", ("evaporat", "condens", "precipit", "water", "cloud", "rain")),
    ("How do earthquakes happen?", ("plate", "tecton", "fault", "crust", "energy", "shak")),
    ("What is democracy?", ("people", "vote", "government", "citizen", "elect")),
    ("What is the difference between weather and climate?", ("long", "short", "term", "average", "day", "year")),
    ("What are vitamins?", ("nutrient", "body", "health", "food", "essential")),
    ("How does sound travel?", ("wave", "vibrat", "air", "medium", "molecule")),
    ("What is electricity?", ("electron", "charge", "current", "energy", "flow")),
    ("What is the largest ocean on Earth?", ("pacific",)),
    ("Who painted the Mona Lisa?", ("leonardo", "vinci")),
    ("What is the freezing point of water?", ("0", "32", "zero", "degree", "celsius")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is a noun?", ("person", "place", "thing", "word", "name")),
    ("What is the sun?", ("star", "hydrogen", "helium", "energy", "light", "heat")),
    ("Why do we need water to live?", ("body", "cell", "hydrat", "temperature", "function", "life")),
    ("What is a fraction?", ("part", "whole", "numerator", "denominator", "divid")),
    ("How do fish breathe underwater?", ("gill", "oxygen", "water")),
    ("What is an ecosystem?", ("organism", "environment", "living", "interact", "community")),
    ("What is a calorie?", ("energy", "food", "heat", "unit")),
    ("How do birds fly?", ("wing", "feather", "lift", "air", "flap")),
    ("What is friction?", ("force", "surface", "resist", "motion", "rub")),
    ("What is the greenhouse effect?", ("heat", "gas", "atmospher", "trap", "carbon", "warm")),
    ("What is a galaxy?", ("star", "system", "milky", "gravity", "billion")),
    ("How does soap clean things?", ("dirt", "grease", "oil", "water", "molecule", "bubble")),
    ("What is the biggest animal in the world?", ("whale",)),
    ("How many days are in a leap year?", ("366",)),
    ("What language is spoken in Brazil?", ("portugu",)),
    ("What is the hardest natural substance?", ("diamond",)),
)


def split_questions(n_heldout: int = 16, seed: int = 0) -> tuple[list[tuple[str, tuple[str, ...]]], list[tuple[str, tuple[str, ...]]]]:
    """(training pool, held-out evaluation set), a fixed shuffle of QUESTIONS."""
    qs = list(QUESTIONS)
    random.Random(seed).shuffle(qs)
    return qs[n_heldout:], qs[:n_heldout]


def validation_questions(size: int = 16, seed: int = 0) -> list[tuple[str, tuple[str, ...]]]:
    """The promotion gate's validation set: the last ``size`` questions of the same fixed shuffle, so it is
    disjoint from the held-out questions (the first ones) whenever held-out + size <= len(QUESTIONS).
    They are part of the training pool: the held-out score the demo reports stays an honest test."""
    if not 1 <= size <= len(QUESTIONS):
        raise ValueError(f"validation size must be in [1, {len(QUESTIONS)}], got {size}")
    qs = list(QUESTIONS)
    random.Random(seed).shuffle(qs)
    return qs[-size:]
