"""The shop: eight products with seeded prices, a cart with quantities, checkout, order pages.

State: `products`, `cart` (product -> quantity), `orders` and `order_items` (what the verifier
checks: an order placed with exactly the asked items, shipping and name).
"""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from openforgerl.web.common import connect, db_path, form, money, redirect, render, templates

NAME = "shop"
SHIPPING = {"standard": ("Standard (3-5 days)", 0), "express": ("Express (next day)", 700)}
MAX_QTY = 9
_POOL = (
    "Blue Mug", "Red Mug", "Notebook", "Desk Lamp", "Pencil Set", "Water Bottle", "Backpack",
    "Headphones", "Phone Stand", "Plant Pot", "Wall Clock", "Tea Towel", "Candle", "Photo Frame",
    "Umbrella", "Wool Scarf", "Board Game", "Jigsaw Puzzle",
)  # fmt: skip

SCHEMA = """
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, price_cents INTEGER NOT NULL);
CREATE TABLE cart (product_id INTEGER PRIMARY KEY REFERENCES products(id), qty INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, name TEXT NOT NULL, shipping TEXT NOT NULL,
  total_cents INTEGER NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id), product_id INTEGER NOT NULL,
  name TEXT NOT NULL, qty INTEGER NOT NULL, price_cents INTEGER NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class Product:
    id: int
    name: str
    price_cents: int

    @property
    def price(self) -> str:
        return money(self.price_cents)


def catalog(seed: int) -> list[Product]:
    """The seeded catalogue: 8 of the pool's products, each with a price from $2.50 to $59.99."""
    rng = random.Random(f"shop-{seed}")
    names = rng.sample(_POOL, 8)
    return [
        Product(i + 1, name, rng.randint(2, 59) * 100 + rng.choice((0, 50, 99, 25)))
        for i, name in enumerate(names)
    ]


def seed_db(db: sqlite3.Connection, seed: int) -> None:
    db.executemany(
        "INSERT INTO products VALUES (?,?,?)", [(p.id, p.name, p.price_cents) for p in catalog(seed)]
    )


PAGES = {
    "home": """{% extends "base" %}{% block main %}
{% if added %}<p class="notice">Added {{ added }} to the cart.</p>{% endif %}
<h1>Products</h1>
<table>{% for p in products %}
<tr><td>{{ p.name }}</td><td class="num">{{ p.price }}</td>
<td class="num"><form method="post" action="/cart/add">
<input type="hidden" name="product_id" value="{{ p.id }}">
<button aria-label="Add {{ p.name }} to cart">Add to cart</button></form></td></tr>
{% endfor %}</table>{% endblock %}""",
    "cart": """{% extends "base" %}{% block main %}
<h1>Your cart</h1>
{% if not items %}<p>Your cart is empty.</p><p><a class="button secondary" href="/">Back to products</a></p>
{% else %}<table>
<tr><th>Product</th><th class="num">Qty</th><th></th><th class="num">Price</th></tr>
{% for it in items %}<tr><td>{{ it.name }}</td><td class="num">{{ it.qty }}</td>
<td><form method="post" action="/cart/update" class="row">
<input type="hidden" name="product_id" value="{{ it.id }}">
<button class="secondary" name="op" value="dec" aria-label="One less {{ it.name }}">&minus;</button>
<button class="secondary" name="op" value="inc" aria-label="One more {{ it.name }}">+</button>
<button class="danger" name="op" value="remove" aria-label="Remove {{ it.name }}">Remove</button></form></td>
<td class="num">{{ it.line }}</td></tr>{% endfor %}
<tr><th>Total</th><td></td><td></td><th class="num">{{ total }}</th></tr></table>
<div class="actions"><a class="button" href="/checkout">Checkout</a>
<a class="button secondary" href="/">Continue shopping</a></div>{% endif %}{% endblock %}""",
    "checkout": """{% extends "base" %}{% block main %}
<h1>Checkout</h1>
{% for e in errors %}<p class="error">{{ e }}</p>{% endfor %}
{% if not items %}<p>Your cart is empty: add products first.</p>{% else %}
<p>{{ count }} item{{ "s" if count != 1 }}, {{ total }} before shipping.</p>
<form method="post" action="/checkout" id="checkout">
<label class="field" for="name">Name</label><input type="text" id="name" name="name" value="{{ name }}"
 autocomplete="off">
<label class="field">Shipping</label><div class="chips">
{% for key, (label, cents) in shipping.items() %}<label><input type="radio" name="shipping" value="{{ key }}"
{% if key == chosen %} checked{% endif %}>{{ label }}{% if cents %} +{{ money(cents) }}{% endif %}</label>
{% endfor %}</div>
<div class="actions"><button>Place order</button>
<a class="button secondary" href="/cart">Back to cart</a></div>
</form>{% endif %}{% endblock %}""",
    "order": """{% extends "base" %}{% block main %}
<p class="notice">Thank you, {{ order.name }}! Order #{{ order.id }} is placed.</p>
<table>{% for it in items %}
<tr><td>{{ it.name }}</td><td class="num">&times; {{ it.qty }}</td></tr>{% endfor %}
<tr><td>Shipping: {{ shipping }}</td><td></td></tr>
<tr><th>Total</th><th class="num">{{ total }}</th></tr></table>
<p><a class="button secondary" href="/">Back to products</a></p>{% endblock %}""",
}
ENV = templates(PAGES)


def _page(template: str, db: sqlite3.Connection, status: int = 200, **context: object) -> Response:
    count = db.execute("SELECT COALESCE(SUM(qty), 0) FROM cart").fetchone()[0]
    nav = [("/", "Products"), ("/cart", f"Cart ({count})")]
    titles = {"home": "Products", "cart": "Cart", "checkout": "Checkout", "order": "Order placed"}
    return render(
        ENV, template, status=status, title=titles[template], brand="Corner Shop", nav=nav, **context
    )


def _cart(db: sqlite3.Connection) -> tuple[list[dict[str, object]], int]:
    rows = db.execute(
        "SELECT p.id, p.name, p.price_cents, c.qty FROM cart c JOIN products p ON p.id = c.product_id"
        " ORDER BY p.id"
    ).fetchall()
    items = [
        {"id": r["id"], "name": r["name"], "qty": r["qty"], "line": money(r["qty"] * r["price_cents"])}
        for r in rows
    ]
    return items, sum(r["qty"] * r["price_cents"] for r in rows)


async def home(request: Request) -> Response:
    with connect(db_path(request)) as db:
        products = [Product(*r) for r in db.execute("SELECT id, name, price_cents FROM products ORDER BY id")]
        added = request.query_params.get("added", "")
        name = next((p.name for p in products if str(p.id) == added), "")
        return _page("home", db, products=products, added=name)


async def cart_add(request: Request) -> Response:
    data = await form(request)
    with connect(db_path(request)) as db:
        row = db.execute("SELECT id FROM products WHERE id = ?", (data.get("product_id", ""),)).fetchone()
        if row is None:
            return _page("home", db, status=400, products=[], added="")
        db.execute(
            "INSERT INTO cart VALUES (?, 1) ON CONFLICT(product_id) DO UPDATE SET qty = MIN(qty + 1, ?)",
            (row["id"], MAX_QTY),
        )
    return redirect(f"/?added={row['id']}")


async def cart(request: Request) -> Response:
    with connect(db_path(request)) as db:
        items, total = _cart(db)
        return _page("cart", db, items=items, total=money(total))


async def cart_update(request: Request) -> Response:
    data = await form(request)
    op, pid = data.get("op"), data.get("product_id", "")
    with connect(db_path(request)) as db:
        if op == "inc":
            db.execute("UPDATE cart SET qty = MIN(qty + 1, ?) WHERE product_id = ?", (MAX_QTY, pid))
        elif op == "dec":
            db.execute("UPDATE cart SET qty = qty - 1 WHERE product_id = ?", (pid,))
        elif op == "remove":
            db.execute("DELETE FROM cart WHERE product_id = ?", (pid,))
        db.execute("DELETE FROM cart WHERE qty <= 0")
    return redirect("/cart")


def _checkout_page(
    db: sqlite3.Connection, errors: list[str], name: str, chosen: str, status: int = 200
) -> Response:
    items, total = _cart(db)
    count = sum(int(str(it["qty"])) for it in items)
    return _page(
        "checkout",
        db,
        status=status,
        items=items,
        count=count,
        total=money(total),
        errors=errors,
        name=name,
        chosen=chosen,
        shipping=SHIPPING,
        money=money,
    )


async def checkout(request: Request) -> Response:
    with connect(db_path(request)) as db:
        return _checkout_page(db, [], "", "standard")


async def place_order(request: Request) -> Response:
    data = await form(request)
    name, shipping = data.get("name", "").strip(), data.get("shipping", "")
    with connect(db_path(request)) as db:
        items, total = _cart(db)
        errors = []
        if not items:
            errors.append("Your cart is empty.")
        if not name:
            errors.append("Please enter your name.")
        elif len(name) > 60:
            errors.append("The name is too long (60 characters at most).")
        if shipping not in SHIPPING:
            errors.append("Please choose a shipping option.")
        if errors:
            return _checkout_page(db, errors, name, shipping, status=400)
        total += SHIPPING[shipping][1]
        order_id = db.execute(
            "INSERT INTO orders (name, shipping, total_cents) VALUES (?,?,?)", (name, shipping, total)
        ).lastrowid
        db.execute(
            "INSERT INTO order_items SELECT ?, p.id, p.name, c.qty, p.price_cents"
            " FROM cart c JOIN products p ON p.id = c.product_id",
            (order_id,),
        )
        db.execute("DELETE FROM cart")
    return redirect(f"/order/{order_id}")


async def order(request: Request) -> Response:
    with connect(db_path(request)) as db:
        row = db.execute("SELECT * FROM orders WHERE id = ?", (request.path_params["id"],)).fetchone()
        if row is None:
            return _page("home", db, status=404, products=[], added="")
        items = db.execute("SELECT name, qty FROM order_items WHERE order_id = ?", (row["id"],)).fetchall()
        return _page(
            "order",
            db,
            order=row,
            items=items,
            shipping=SHIPPING[row["shipping"]][0],
            total=money(row["total_cents"]),
        )


def routes() -> list[BaseRoute]:
    return [
        Route("/", home),
        Route("/cart", cart),
        Route("/cart/add", cart_add, methods=["POST"]),
        Route("/cart/update", cart_update, methods=["POST"]),
        Route("/checkout", checkout),
        Route("/checkout", place_order, methods=["POST"]),
        Route("/order/{id:int}", order),
    ]
