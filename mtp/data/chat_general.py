"""Training chat prompts outside the standard library (``mtp.data.chat``'s
categories ``math``, ``translate``, ``write`` and ``general``), composed from
the word lists below and random numbers (no corpus, no download): math word
problems with drawn numbers; translations of composed sentences or pydoc
sentences into nine languages; short writing forms about a topic; explain,
compare, list or summarise a subject. The held-out set's topics are left
out of the lists on purpose (tests/test_chat_data.py checks the overlap).
Each function takes a ``numpy.random.Generator`` and is deterministic for it.
"""

from __future__ import annotations

import re

import numpy as np

GENERAL_CATEGORIES = ("math", "translate", "write", "general")

LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish",
             "Polish", "Japanese")

_SUBJECTS = ("My grandmother", "The young doctor", "Our neighbour", "The bus driver",
             "A little boy", "The students", "My best friend", "The old fisherman",
             "Her parents", "The new manager", "Two tourists", "The baker", "My uncle",
             "The children", "Everyone in the office", "The singer", "A police officer",
             "My cousin and I", "The farmer", "Our teacher")
_ACTIONS = ("bought fresh bread", "is painting the fence", "forgot the umbrella",
            "will visit the museum", "likes to drink tea", "lost the keys",
            "is learning to swim", "cooked dinner for ten people", "wrote a long letter",
            "missed the last train", "planted tomatoes", "is waiting for a taxi",
            "sold the old car", "found a wallet", "played the piano",
            "booked a table for two", "fixed the bicycle", "read the newspaper",
            "walked the dog", "is looking for a new flat")
_WHERE_WHEN = ("this morning", "at the market", "near the river", "every Saturday",
               "before breakfast", "in the garden", "after work", "at the airport",
               "last summer", "in the kitchen", "on Monday evening", "at the station",
               "during the storm", "in the small village", "yesterday afternoon",
               "next to the bank", "at midnight", "in the city centre")
_TRANSLATE = (
    "Translate into {lang}: \"{s}\"",
    "Please translate this sentence to {lang}: {s}",
    "How would I say \"{s}\" in {lang}?",
    "Give the {lang} translation of: {s}",
    "Translate the following English text into {lang}.\n\n{s}",
)

_FORMS = ("a short poem", "a haiku", "a limerick", "the first paragraph of a short story",
          "a friendly email", "a formal letter", "a short speech", "a blog post introduction",
          "a diary entry", "a product description", "a short advertisement",
          "a text message", "a birthday card message", "a two-line rhyme",
          "a short dialogue between two people", "a one-paragraph fairy tale",
          "a thank-you note", "a job advertisement")
_TOPICS = ("a lighthouse keeper", "a lost umbrella", "moving to a new city", "a bakery at dawn",
           "a broken clock", "learning to ride a bicycle", "a rainy Monday", "a robot gardener",
           "an old bookshop", "a first day at work", "a village festival", "a paper boat",
           "a dragon who is afraid of the dark", "a new coffee machine", "a school trip",
           "a mountain hut", "a forgotten birthday", "a busy train station",
           "a vegetable garden", "a fox in the city", "a lost dog finding its way home",
           "a violin teacher", "a picnic in the park", "a snowman that will not melt",
           "a wedding on a boat", "an inventor's workshop", "a quiet library",
           "a jazz concert", "a kite on a windy day", "a new pair of running shoes",
           "an office plant", "a family recipe", "a desert road trip", "a space station cook",
           "a clumsy wizard", "a volunteer fire brigade")
_TONES = ("", "", " in a cheerful tone", " in a formal tone", " for children",
          " with a surprising ending", " in under 80 words", " in a humorous style")
_WRITE = (
    "Write {form} about {topic}{tone}.",
    "Could you write {form} about {topic}{tone}?",
    "I need {form} about {topic}{tone}. Please write it.",
)

_CONCEPTS = ("inflation", "the water cycle", "gravity", "compound interest", "a vaccine",
             "an earthquake", "democracy",
             "supply and demand", "the immune system", "a black hole", "electric current",
             "evolution by natural selection", "a volcano", "the greenhouse effect",
             "a credit score", "the stock market", "recycling", "a solar panel",
             "the internet", "a tsunami", "antibiotics", "a calorie", "the human heart",
             "magnetism", "a hurricane", "an election", "sound waves", "friction",
             "the placebo effect", "a mortgage", "tides", "fossils", "a nuclear reactor",
             "the metric system", "GPS navigation", "a tax return", "an eclipse of the moon",
             "a coral reef")
_PAIRS = (("a virus", "a bacterium"), ("a lake", "a sea"), ("a crocodile", "an alligator"),
          ("a loan", "a grant"), ("speed", "velocity"), ("a frog", "a toad"),
          ("mass", "weight"), ("a town", "a city"), ("baking soda", "baking powder"),
          ("a hill", "a mountain"), ("an ape", "a monkey"), ("a debit card", "a credit card"),
          ("a poem", "a song"), ("a comet", "an asteroid"), ("a democracy", "a monarchy"),
          ("a bicycle", "a motorcycle"), ("tea", "coffee"), ("a river", "a canal"))
_SUBJECTS_FACTS = ("the Amazon rainforest", "honey bees", "the Roman Empire", "the piano",
                   "the Olympic Games", "elephants", "the Sahara desert", "penguins",
                   "the printing press", "chess", "the Eiffel Tower", "the human brain",
                   "volcanoes in Iceland", "the Nile", "octopuses", "the telephone",
                   "the Moon landing", "whales", "the Pyramids of Giza", "paper money")
_WORKS = ("Moby-Dick", "The Odyssey", "Don Quixote", "Hamlet", "Frankenstein",
          "Treasure Island", "Jane Eyre", "The Hobbit", "Oliver Twist", "Little Women",
          "the French Revolution", "the invention of the steam engine",
          "the voyage of Christopher Columbus", "the fall of the Berlin Wall",
          "the Industrial Revolution", "the first flight of the Wright brothers")
_GENERAL = (
    ("Explain {c} in simple terms.", "concept"),
    ("What is {c}, and why does it matter?", "concept"),
    ("Can you explain how {c} works to a twelve-year-old?", "concept"),
    ("How is {a} different from {b}?", "pair"),
    ("Compare {a} and {b} in a few sentences.", "pair"),
    ("Tell me three interesting facts about {s}.", "facts"),
    ("Give me a short introduction to {s}.", "facts"),
    ("Briefly summarise {w}.", "work"),
    ("In a short paragraph, what is {w} about?", "work"),
)

_ITEMS = ("notebooks", "apples", "tickets", "pencils", "bottles of juice", "plants", "towels",
          "candles", "mugs", "loaves of bread")
_NAMES = ("Ana", "Tom", "Priya", "Lukas", "Mei", "Omar", "Sara", "Diego", "Hana", "Ivan")


# Content lists split between training and validation prompts (templates,
# languages and numbers are shared).
_SPLIT_LISTS = (_SUBJECTS, _ACTIONS, _WHERE_WHEN, _TOPICS, _CONCEPTS, _PAIRS, _SUBJECTS_FACTS,
                _WORKS, _ITEMS, _NAMES)


def _picker(rng, split: str):
  """``pick(seq)``: a random element of ``seq``. For the content lists
  (``_SPLIT_LISTS``: topics, concepts, sentence parts, names) the validation
  split draws only every tenth element (indices 0, 10, ...) and any other
  split the rest, so a validation prompt's topic is never a training
  prompt's; templates, languages and numbers are shared."""
  def pick(seq):
    if any(seq is lst for lst in _SPLIT_LISTS):
      idx = [i for i in range(len(seq)) if (i % 10 == 0) == (split == "validation")]
      return seq[idx[int(rng.integers(len(idx)))]]
    return seq[int(rng.integers(len(seq)))]
  return pick


def _math(rng, pick) -> str:
  r = lambda lo, hi: int(rng.integers(lo, hi + 1))   # noqa: E731
  kind = int(rng.integers(14))
  if kind == 0:
    a, b = r(12, 999), r(12, 999)
    op = pick(("+", "-", "*"))
    return pick(("Calculate {a} {op} {b}.", "What do you get for {a} {op} {b}?",
                       "Work out {a} {op} {b} and show the steps.")).format(a=a, op=op, b=b)
  if kind == 1:
    b = r(3, 25)
    a = b * r(4, 60)
    return f"Divide {a} by {b}. What is the result?"
  if kind == 2:
    p, n = pick((5, 10, 12, 15, 25, 30, 40, 75)), r(2, 90) * 10
    return pick(("Find {p}% of {n}.", "How much is {p} percent of {n}?")).format(p=p, n=n)
  if kind == 3:
    a, x, b = r(2, 12), r(-9, 15), r(1, 40)
    sign = pick(("+", "-"))
    c = a * x + b if sign == "+" else a * x - b
    return pick(("Find x if {a}x {s} {b} = {c}.",
                       "What value of x satisfies {a}x {s} {b} = {c}?")).format(a=a, s=sign, b=b, c=c)
  if kind == 4:
    return pick((f"How many seconds are there in {r(2, 48)} hours?",
                       f"Convert {r(2, 500)} kilometres to metres.",
                       f"How many minutes are {r(2, 20)} and a half hours?",
                       f"Convert {r(1, 40) * 100} grams to kilograms.",
                       f"How many centimetres are in {r(2, 30)} metres and {r(1, 99)} centimetres?"))
  if kind == 5:
    xs = [r(1, 100) for _ in range(r(4, 7))]
    return pick(("Find the mean of these numbers: {xs}.",
                       "What is the average of {xs}?",
                       "Give the median and the mean of {xs}.")).format(xs=", ".join(map(str, xs)))
  if kind == 6:
    w, h = r(2, 40), r(2, 40)
    return pick((f"A rectangle is {w} m long and {h} m wide. What are its area and perimeter?",
                       f"What is the area of a triangle with base {w} cm and height {h} cm?",
                       f"A square garden has sides of {w} metres. How much fence goes around it?"))
  if kind == 7:
    v, t = r(12, 28), r(2, 6)
    return (f"A cyclist rides {v * t} km in {t} hours at a constant pace. How far does she get "
            f"in {t + r(1, 3)} hours?")
  if kind == 8:
    n, p = r(3, 15), r(2, 25)
    item = pick(_ITEMS)
    name = pick(_NAMES)
    pay = (n * p // 10 + 1) * 10 + pick((0, 10, 20))
    return (f"{name} buys {n} {item} at ${p} each and pays with ${pay}. How much change "
            f"does {name} get back?")
  if kind == 9:
    a, b = r(6, 120), r(6, 120)
    return pick(("What is the greatest common divisor of {a} and {b}?",
                       "Find the least common multiple of {a} and {b}.")).format(a=a, b=b)
  if kind == 10:
    n = r(30, 600)
    return pick(("Is {n} divisible by 3? Explain how you can tell.",
                       "List all the factors of {n}.",
                       "Write {n} as a product of prime factors.")).format(n=n)
  if kind == 11:
    a, b = r(2, 9), r(2, 5)
    return pick((f"What is {a} to the power of {b}?", f"Simplify the fraction {a * 6}/{b * 6 + 6}.",
                       f"What is {a}/{b + 5} plus 1/{b}? Give the answer as a fraction."))
  if kind == 12:
    k, m = r(2, 8), r(3, 12)
    return (f"{k} workers build a wall in {m} days. Working at the same rate, how long would "
            f"{k * 2} workers take?")
  a, b = r(10, 80), r(10, 80)
  name = pick(_NAMES)
  return (f"{name} has {a} stickers and gives {b // 2} of them away, then buys {b} more. How many "
          f"stickers does {name} have now?")


def _translate(rng, pick, first_sentence: str | None) -> str:
  lang = pick(LANGUAGES)
  if first_sentence is not None:
    s = first_sentence
  else:
    s = f"{pick(_SUBJECTS)} {pick(_ACTIONS)} {pick(_WHERE_WHEN)}."
  return pick(_TRANSLATE).format(lang=lang, s=s)


def _write(rng, pick) -> str:
  return pick(_WRITE).format(form=pick(_FORMS), topic=pick(_TOPICS),
                                   tone=pick(_TONES))


def _general(rng, pick) -> str:
  tmpl, kind = pick(_GENERAL)
  if kind == "concept":
    return tmpl.format(c=pick(_CONCEPTS))
  if kind == "pair":
    a, b = pick(_PAIRS)
    if rng.random() < 0.5:
      a, b = b, a
    return tmpl.format(a=a, b=b)
  if kind == "facts":
    return tmpl.format(s=pick(_SUBJECTS_FACTS))
  return tmpl.format(w=pick(_WORKS))


def first_sentence(text: str, *, min_chars: int = 30, max_chars: int = 200) -> str | None:
  """The first sentence of ``text`` (up to the first '. ' / '.\\n' / end), with
  whitespace collapsed, when it has ``min_chars``..``max_chars`` characters
  and no code markup; else None."""
  flat = " ".join(text.split())
  m = re.match(r"(.+?[.!?])(\s|$)", flat)
  s = m.group(1) if m else flat
  if not (min_chars <= len(s) <= max_chars) or any(ch in s for ch in "`*>{}[]=_|\\"):
    return None
  return s


def general_prompt(category: str, rng: np.random.Generator, *, split: str = "train",
                   pydoc_sentence: str | None = None) -> str:
  """One user message of ``category`` (one of ``GENERAL_CATEGORIES``).

  ``split``: ``"validation"`` draws every word-list element and template from
  a tenth of each list that no other split uses (``_picker``), so validation
  prompts are not training prompts with other numbers. ``pydoc_sentence``:
  for ``translate``, a sentence to translate instead of a composed one (the
  caller draws it from a pydoc topic of the same split). Raises ValueError
  for any other category.
  """
  pick = _picker(rng, split)
  if category == "math":
    return _math(rng, pick)
  if category == "translate":
    return _translate(rng, pick, pydoc_sentence)
  if category == "write":
    return _write(rng, pick)
  if category == "general":
    return _general(rng, pick)
  raise ValueError(f"unknown general chat category {category!r}; known: {GENERAL_CATEGORIES}")
