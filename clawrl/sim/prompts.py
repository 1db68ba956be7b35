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


# The promotion gate's validation questions: never asked in training and never in the held-out set,
# so the gate measures what the curve measures (answers to unseen questions) without reading the test.
VALIDATION_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("How do clouds form?", ("water", "vapor", "vapour", "condens", "droplet", "cool", "air")),
    ("What is erosion?", ("wind", "water", "rock", "soil", "wear", "move", "ice")),
    ("How do bats find their way in the dark?", ("echo", "sound", "ultrason", "bounce", "hear")),
    ("What is a fossil?", ("remain", "rock", "ancient", "bone", "preserv", "organism", "plant", "animal")),
    ("Why do we sweat?", ("cool", "heat", "temperature", "body", "evaporat", "skin")),
    ("What is a comet?", ("ice", "dust", "tail", "sun", "orbit", "rock", "frozen")),
    ("How does a compass work?", ("magnet", "north", "needle", "field", "pole", "earth")),
    ("What is the job of the kidneys?", ("blood", "filter", "waste", "urine", "water", "toxin")),
    ("What is a habitat?", ("home", "live", "environment", "animal", "plant", "organism", "natural")),
    ("How do seeds grow into plants?", ("germinat", "root", "water", "soil", "sprout", "light", "sun")),
    ("What is a tsunami?", ("wave", "ocean", "earthquake", "sea", "water", "coast")),
    ("Why does ice float on water?", ("dens", "less", "expand", "molecule", "lighter", "crystal")),
    ("What is evolution?", ("species", "change", "natural", "selection", "generation", "adapt", "darwin")),
    ("How does the stomach digest food?", ("acid", "enzyme", "break", "juice", "muscle", "churn", "protein")),
    ("What is a solar eclipse?", ("moon", "sun", "block", "shadow", "light", "earth")),
    ("What is a molecule?", ("atom", "bond", "chemical", "particle", "compound", "smallest")),
    ("How do muscles move the body?", ("contract", "bone", "fiber", "fibre", "tendon", "pull", "nerve")),
    ("What is a desert?", ("dry", "rain", "sand", "little", "hot", "arid", "cold")),
    ("What is a battery?", ("energy", "chemical", "electric", "store", "charge", "current", "power")),
    ("How do bees help flowers?", ("pollen", "pollinat", "nectar", "seed", "fruit", "plant")),
    ("What is carbon dioxide?", ("gas", "carbon", "oxygen", "breath", "plant", "molecule", "air")),
    ("What makes thunder?", ("lightning", "heat", "air", "expand", "sound", "shock")),
    ("What is the capital of Japan?", ("tokyo",)),
    ("How many planets are in our solar system?", ("eight", "8")),
    ("What is the largest country by area?", ("russia",)),
    ("Who was the first person to walk on the Moon?", ("armstrong", "neil")),
    ("What is the chemical formula for water?", ("h2o", "hydrogen", "oxygen")),
    ("What is the smallest prime number?", ("two", "2")),
    ("How many sides does a hexagon have?", ("six", "6")),
    ("What is the longest river in the world?", ("nile", "amazon")),
    ("Which planet is known as the Red Planet?", ("mars",)),
    ("What is the main language spoken in Mexico?", ("spanish",)),
)


# Plain questions for the tools scenario's promotion gate (clawrl.sim.validation:tools): in neither
# QUESTIONS nor VALIDATION_QUESTIONS, so neither trained on, held out, nor among the tools bench's unseen ones.
GATE_PLAIN_QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is a glacier?", ("ice", "snow", "slow", "mov", "frozen", "mass")),
    ("How do spiders make webs?", ("silk", "spin", "thread", "gland", "sticky")),
    ("What is pollution?", ("harm", "air", "water", "chemical", "waste", "environment")),
    ("Why do stars twinkle?", ("atmospher", "air", "light", "bend", "refract", "turbulen")),
    ("What is a coral reef?", ("coral", "ocean", "sea", "animal", "polyp", "fish", "underwater")),
    ("How does the brain send signals?", ("neuron", "nerve", "electric", "chemical", "synap", "signal")),
    ("What is a rainforest?", ("tree", "rain", "tropical", "forest", "wet", "species", "dense")),
    ("How do caterpillars become butterflies?", ("cocoon", "chrysalis", "metamorph", "pupa", "transform")),
    ("What is wind?", ("air", "move", "pressure", "flow", "heat")),
    ("What are clouds made of?", ("water", "droplet", "ice", "vapor", "vapour", "crystal")),
    ("How do plants make seeds?", ("flower", "pollen", "pollinat", "fertiliz", "ovule", "fruit")),
    ("What is a microscope used for?", ("small", "magnif", "see", "cell", "tiny", "lens")),
    ("Why do birds migrate?", ("food", "warm", "winter", "season", "breed", "weather")),
    ("What is the job of red blood cells?", ("oxygen", "carry", "hemoglobin", "haemoglobin", "body")),
    ("How do solar panels make electricity?", ("sun", "light", "photovolta", "cell", "electron", "energy")),
    ("What is an island?", ("land", "water", "surround", "sea", "ocean")),
)


def validation_questions(size: int = 16, seed: int = 0) -> list[tuple[str, tuple[str, ...]]]:
    """The promotion gate's validation set: ``size`` questions of a fixed shuffle of
    VALIDATION_QUESTIONS, which share none with QUESTIONS - neither the training pool nor the
    held-out questions - so a candidate is judged on questions it never trained on and the held-out
    score the demo reports stays an honest test."""
    if not 1 <= size <= len(VALIDATION_QUESTIONS):
        raise ValueError(f"validation size must be in [1, {len(VALIDATION_QUESTIONS)}], got {size}")
    qs = list(VALIDATION_QUESTIONS)
    random.Random(seed).shuffle(qs)
    return qs[:size]
