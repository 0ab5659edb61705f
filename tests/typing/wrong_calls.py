"""Calls a type checker must refuse (tests/typing/check.py): each line that ends in an `expect:` comment must be
reported with that comment's text in its message. Never run."""

import strideweave as sw

carrier = sw.CPU(4)
sw.Tensor("carrier", 0, sw.column_major(4))  # expect: Argument 1 to "Tensor" has incompatible type "str"
sw.Tensor(carrier, 0.5, sw.column_major(4))  # expect: Argument 2 to "Tensor" has incompatible type "float"
sw.FileBacked(42)  # expect: Argument 1 to "FileBacked" has incompatible type "int"
sw.Evictable(carrier, "secondary")  # expect: Argument 2 to "Evictable" has incompatible type "str"
sw.move_async(carrier, carrier)  # expect: Argument 1 to "move_async" has incompatible type "CPU"
sw.Layout(sw.Shape(2), 7)  # expect: Argument 2 to "Layout" has incompatible type "int"
t = sw.Tensor(carrier, 0, sw.column_major(4))
t[0] = "one"  # expect: Incompatible types in assignment
t.grad = carrier  # expect: Incompatible types in assignment
sw.matmul("x", t)  # expect: Argument 1 to "matmul" has incompatible type "str"
sw.add(t, "one")  # expect: Argument 2 to "add" has incompatible type "str"
sw.TiledEvictable(carrier, carrier, (2,), (2,)).project(t, [[0]])  # expect: Argument 2 to "project" of "TiledEvictable" has incompatible type
