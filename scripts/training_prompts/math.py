"""Math word problems: gsm8k's training lines and templated problems with varied names, numbers, units and questions.

Every template draws its numbers so that the answer is a whole number (prices in whole dollars or cents that add
up, counts that divide), as in grade-school problems; the answers themselves are not written: the target solves them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path


GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
OTHER_SUFFIXES = ["", "", "", "\nShow your work.", " Explain your reasoning.", "\nSolve step by step."]

NAMES = """Aiden Amara Ben Carlos Chloe Daniel Diego Elena Emma Fatima Finn Grace Hana Hiro Isabel Ivan Jamal James Jia
Kai Kofi Laila Leo Lucia Maria Mateo Maya Mei Mohammed Nadia Noah Olivia Omar Priya Rafael Ravi Rosa Sam Sara Sofia
Tariq Tom Uma Victor Wei Yara Yusuf Zoe Anna Bruno Chen Dmitri Esther Felix Gabriel Helen Ines Jonas Keiko Liam Mina
Nikolai Paula Quinn Rahul Selma Theo Ursula Vera Wanda Xavier Yuki Zara""".split()
ITEMS = [("notebook", "notebooks"), ("pencil", "pencils"), ("apple", "apples"), ("sandwich", "sandwiches"),
         ("T-shirt", "T-shirts"), ("book", "books"), ("ticket", "tickets"), ("candle", "candles"), ("plant", "plants"),
         ("cupcake", "cupcakes"), ("toy car", "toy cars"), ("bottle of juice", "bottles of juice"), ("mug", "mugs"),
         ("pair of socks", "pairs of socks"), ("comic book", "comic books"), ("bag of rice", "bags of rice")]
THINGS = [("seashell", "seashells"), ("stamp", "stamps"), ("marble", "marbles"), ("sticker", "stickers"),
          ("baseball card", "baseball cards"), ("coin", "coins"), ("rock", "rocks"), ("postcard", "postcards")]
JOBS = ["babysitting", "tutoring", "walking dogs", "mowing lawns", "working at a bakery", "washing cars",
        "delivering newspapers", "working at the library"]


def _names(rng: random.Random, count: int) -> list[str]:
    return rng.sample(NAMES, count)


def shopping(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    (one, many), (one2, many2) = rng.sample(ITEMS, 2)
    a, b, p, q = rng.randint(2, 9), rng.randint(2, 6), rng.randint(2, 15), rng.randint(3, 25)
    bill = next(value for value in (20, 50, 100, 200, 500) if value >= a * p + b * q)
    question = rng.choice([f"How much change does {name} get back?", f"How much money does {name} have left?",
                           "How many dollars in change should the cashier give back?"])
    return (f"{name} buys {a} {many} for ${p} each and {b} {many2} for ${q} each. {name} pays with a ${bill} bill. "
            f"{question}")


def earnings(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    hours, rate, days, percent = rng.randint(2, 8), rng.randint(8, 30), rng.randint(3, 20), rng.choice([10, 20, 25, 50])
    return (f"{name} earns ${rate} an hour {rng.choice(JOBS)}. {name} works {hours} hours a day for {days} days and "
            f"spends {percent}% of the money on {rng.choice(['a new bike', 'books', 'a gift', 'a concert ticket'])}. "
            f"How much money does {name} have left?")


def travel(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    unit = rng.choice([("miles", "mph"), ("kilometers", "km/h")])
    s1, t1, s2, t2 = rng.randrange(30, 75, 5), rng.randint(1, 4), rng.randrange(40, 80, 5), rng.randint(1, 3)
    question = rng.choice([f"How many {unit[0]} does {name} travel in total?",
                           f"What is the total distance {name} covers, in {unit[0]}?"])
    return (f"{name} drives at {s1} {unit[1]} for {t1} hours, stops for lunch, and then drives at {s2} {unit[1]} for "
            f"{t2} more hours. {question}")


def work_rate(rng: random.Random) -> str:
    names = _names(rng, 2)
    a, b, hours = rng.randint(3, 12), rng.randint(3, 12), rng.randint(2, 8)
    total = (a + b) * hours
    thing = rng.choice(["boxes", "cookies", "bracelets", "paper cranes", "birdhouses", "scarves"])
    return (f"{names[0]} can make {a} {thing} an hour and {names[1]} can make {b} {thing} an hour. Working together, "
            f"how many hours will it take them to make {total} {thing}?")


def ages(rng: random.Random) -> str:
    names = _names(rng, 3)
    young, factor, years, diff = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 10), rng.randint(2, 9)
    return (f"{names[0]} is {factor} times as old as {names[1]}, who is {young} years old. {names[2]} is {diff} years "
            f"younger than {names[0]}. How old will {names[2]} be in {years} years?")


def discount(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    one, many = rng.choice(ITEMS)
    price, percent, count = rng.randrange(20, 200, 20), rng.choice([10, 20, 25, 50]), rng.randint(2, 5)
    return (f"A store sells {many} for ${price} each. This week they are {percent}% off. {name} buys {count} {many}. "
            f"How much does {name} pay?")


def recipe(rng: random.Random) -> str:
    servings, factor, cups = rng.choice([2, 4, 6, 8]), rng.randint(2, 5), rng.randint(1, 4)
    ingredient = rng.choice(["flour", "sugar", "milk", "rice", "oats"])
    other, amount = rng.choice([("eggs", rng.randint(2, 4)), ("spoons of butter", rng.randint(1, 3))])
    return (f"A recipe for {servings} servings uses {cups} cups of {ingredient} and {amount} {other}. How many cups of "
            f"{ingredient} and how many {other} are needed for {servings * factor} servings?")


def savings(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    start, weekly, weeks = rng.randrange(10, 100, 5), rng.randrange(5, 40, 5), rng.randint(3, 20)
    goal = start + weekly * weeks
    item = rng.choice(["a bicycle", "a video game console", "a guitar", "a tablet", "a telescope", "a tent"])
    return (f"{name} wants to buy {item} that costs ${goal}. {name} already has ${start} and saves ${weekly} every "
            f"week. How many weeks will it take {name} to have enough money?")


def fractions_of_group(rng: random.Random) -> str:
    a, b = rng.choice([(2, 3), (3, 4), (4, 5), (2, 5), (3, 5), (5, 2), (4, 3)])
    total = a * b * rng.randint(2, 6)
    group = rng.choice(["students in a class", "people at a party", "members of a club", "runners in a race"])
    likes = rng.sample(["soccer", "basketball", "chess", "swimming", "painting", "music"], 2)
    return (f"There are {total} {group}. One {_ordinal(a)} of them like {likes[0]}, and one {_ordinal(b)} of the "
            f"rest like {likes[1]}. How many like neither?")


def _ordinal(number: int) -> str:
    return {2: "half", 3: "third", 4: "quarter", 5: "fifth", 6: "sixth"}[number]


def garden(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    length, width, cost = rng.randint(5, 30), rng.randint(3, 20), rng.randint(2, 15)
    unit = rng.choice(["meters", "feet", "yards"])
    question = rng.choice([f"How much will the fence cost?", f"What is the area of the garden, and how much does the "
                                                               f"fence cost?"])
    return (f"{name} has a rectangular garden that is {length} {unit} long and {width} {unit} wide. A fence around it "
            f"costs ${cost} per {unit[:-1] if unit != 'feet' else 'foot'}. {question}")


def split_bill(rng: random.Random) -> str:
    friends, tip = rng.randint(2, 8), rng.choice([10, 20, 25])
    meal = friends * 20 * rng.randint(1, 6)  # a multiple of 20 per friend: every tip leaves whole dollars each
    return (f"{friends} friends have dinner and the bill is ${meal}. They add a {tip}% tip and split the total "
            f"equally. How much does each friend pay?")


def inventory(rng: random.Random) -> str:
    start, monday, shipment = rng.randint(100, 500), rng.randint(10, 40), rng.randint(20, 150)
    one, many = rng.choice(ITEMS)
    return (f"A shop has {start} {many}. It sells {monday} on Monday, twice as many on Tuesday, and {monday - 5} on "
            f"Wednesday. On Thursday a delivery of {shipment} {many} arrives. How many {many} does the shop have now?")


def reading(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    per_day, days, more_days = rng.randint(5, 30), rng.randint(2, 7), rng.randint(2, 8)
    pages = per_day * days + 2 * per_day * more_days
    return (f"{name} is reading a book with {pages} pages. {name} reads {per_day} pages a day for the first {days} "
            f"days and then doubles the pace. How many days does it take {name} to finish the book in all?")


def conversion(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    choice = rng.randrange(3)
    if choice == 0:
        km, days = rng.randint(2, 9), rng.randint(3, 7)
        return f"{name} walks {km}.5 kilometers every day for {days} days. How many meters does {name} walk in total?"
    if choice == 1:
        minutes, sessions = rng.choice([15, 20, 30, 45]), rng.choice([4, 8, 12, 16])
        return (f"{name} practices the piano for {minutes} minutes, {sessions} times a month. How many hours does "
                f"{name} practice in a year?")
    liters, bottle = rng.randint(2, 12), rng.choice([250, 500])
    return f"How many {bottle} ml bottles can be filled from {liters} liters of lemonade?"


def average_score(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    scores = [rng.randint(70, 95) for _ in range(rng.randint(3, 5))]
    target = (sum(scores) + rng.randint(80, 100)) // (len(scores) + 1)
    return (f"{name}'s test scores so far are {', '.join(map(str, scores[:-1]))} and {scores[-1]}. What score does "
            f"{name} need on the next test to have an average of at least {target}?")


def interest(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    principal, rate, years = rng.randrange(500, 10000, 500), rng.choice([2, 3, 4, 5, 6, 8, 10]), rng.randint(2, 6)
    return (f"{name} puts ${principal} in a savings account that pays {rate}% simple interest per year. How much money "
            f"will be in the account after {years} years?")


def ratio(rng: random.Random) -> str:
    a, b, k = rng.randint(1, 7), rng.randint(1, 7), rng.randint(3, 12)
    things = rng.choice([("red marbles", "blue marbles", "marbles in a jar"), ("boys", "girls", "children on a trip"),
                         ("cats", "dogs", "animals at a shelter"), ("apples", "oranges", "pieces of fruit in a box")])
    return (f"The ratio of {things[0]} to {things[1]} is {a}:{b}. There are {(a + b) * k} {things[2]}. How many more "
            f"{things[1]} than {things[0]} are there?" if b > a else
            f"The ratio of {things[0]} to {things[1]} is {a}:{b}. There are {(a + b) * k} {things[2]}. How many "
            f"{things[1]} are there?")


def fuel(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    mpg, gallons, price = rng.randrange(20, 45, 5), rng.randint(1, 6), rng.randint(3, 6)
    return (f"{name}'s car goes {mpg} miles on a gallon of gas, and gas costs ${price} a gallon. How much does gas "
            f"cost for a round trip to a city {mpg * gallons} miles away?")


def collections_total(rng: random.Random) -> str:
    names = _names(rng, 3)
    one, many = rng.choice(THINGS)
    x, more = rng.randint(5, 40), rng.randrange(2, 10, 2)
    return (f"{names[0]} has {x} {many}. {names[1]} has {more} more than twice as many as {names[0]}, and {names[2]} "
            f"has half as many as {names[1]}. How many {many} do they have altogether?")


def growth(rng: random.Random) -> str:
    start, percent = rng.randrange(100, 2000, 100), rng.choice([10, 20, 50])
    thing = rng.choice(["The population of a town", "The number of members of a club", "The price of a painting",
                        "The number of visitors to a website"])
    return (f"{thing} is {start}. It grows by {percent}% every year. What will it be after 2 years?")


def packing(rng: random.Random) -> str:
    per_box, boxes, extra = rng.randint(4, 24), rng.randint(5, 40), rng.randint(1, 20)
    one, many = rng.choice(ITEMS)
    extra %= per_box
    return (f"A factory packs {many} into boxes of {per_box}. It has {per_box * boxes + extra} {many}. How many full "
            f"boxes can it pack, and how many {many} are left over?")


def painting(rng: random.Random) -> str:
    name = _names(rng, 1)[0]
    rooms, walls, liters, can = rng.randint(2, 6), 4, rng.choice([2, 3, 4]), rng.choice([5, 10])
    return (f"{name} is painting {rooms} rooms. Each room has {walls} walls and each wall needs {liters} liters of "
            f"paint. Paint is sold in {can}-liter cans. How many cans does {name} need to buy?")


def subscription(rng: random.Random) -> str:
    monthly, discount_percent = rng.randint(5, 30), rng.choice([10, 20, 25])
    service = rng.choice(["a music service", "a gym", "a streaming service", "an online course platform"])
    return (f"A monthly plan for {service} costs ${monthly}. A yearly plan costs {discount_percent}% less than paying "
            f"monthly for 12 months. How much money does the yearly plan save?")


def heads_and_legs(rng: random.Random) -> str:
    chickens, cows = rng.randint(3, 30), rng.randint(2, 20)
    animals = rng.choice([("chickens", "cows"), ("ducks", "goats"), ("geese", "sheep")])
    return (f"A farm has only {animals[0]} and {animals[1]}. There are {chickens + cows} heads and "
            f"{2 * chickens + 4 * cows} legs. How many {animals[1]} are on the farm?")


def meeting(rng: random.Random) -> str:
    names = _names(rng, 2)
    s1, s2, hours = rng.randrange(40, 90, 5), rng.randrange(40, 90, 5), rng.randint(2, 5)
    return (f"{names[0]} and {names[1]} live {(s1 + s2) * hours} miles apart. They leave home at the same time and "
            f"drive toward each other, {names[0]} at {s1} mph and {names[1]} at {s2} mph. After how many hours do they "
            f"meet, and how far has {names[0]} driven by then?")


TEMPLATES: list[Callable[[random.Random], str]] = [
    shopping, earnings, travel, work_rate, ages, discount, recipe, savings, fractions_of_group, garden, split_bill,
    inventory, reading, conversion, average_score, interest, ratio, fuel, collections_total, growth, packing, painting,
    subscription, heads_and_legs, meeting,
]


def templated_problems(count: int, rng: random.Random) -> list[str]:
    """`count` distinct problems, cycling over the templates, each with a GSM8K-style or another closing line."""
    problems, seen = [], set()
    attempts = 0
    while len(problems) < count and attempts < count * 20:
        attempts += 1
        problem = TEMPLATES[attempts % len(TEMPLATES)](rng)
        if problem in seen:
            continue
        seen.add(problem)
        suffix = GSM8K_SUFFIX if rng.random() < 0.55 else rng.choice(OTHER_SUFFIXES)
        problems.append(problem + suffix)
    return problems


def gsm8k_training_prompts(path: Path, first_line: int = 501, last_line: int = 1100) -> list[str]:
    """The user turns of lines `first_line..last_line` (1-based, inclusive) of the GSM8K eval file."""
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file {str(path)!r} does not exist; pass --gsm8k path/to/gsm8k.jsonl.")
    lines = path.read_text(encoding="utf-8").splitlines()[first_line - 1:last_line]
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]
