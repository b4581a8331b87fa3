"""Models used across the book; arrays in the package name their shape with these suffixes.

A suffix spells an array's axes in order, one capital letter each (``x_BTD``: batch,
tokens, width); a lowercase einsum subscript is the same letter. Each letter has one
meaning, here and in every module, page and example script::

    B  batch (examples in a batch)
    T  tokens: positions in a sequence; also a batch's tokens flattened, or a routing
       group's tokens
    S  key/value positions in attention, where they differ from the queries' T
    D  model width (embedding width)
    N  attention (query) heads
    K  key/value heads (grouped-query attention; K = N without it)
    Q  query heads that share one key/value head (N = K * Q)
    A  width of one attention head
    F  MLP hidden width
    V  vocabulary
    O  a classifier's outputs (classes)
    E  experts
    M  slots per expert (its capacity)
    R  a token's routes: its top-k expert choices
    G  routing groups (tokens routed together)
    X  devices along the `expert` mesh axis;  L  experts on one device (E = X * L)
    U  (token, route) pairs, flattened (dropless experts sort them by expert)
    Y  rows a device can receive over `expert`: X * U, room for every device's pairs
    H, W, C  an image's height, width and colour channels (images only)
    P  pixel values of one patch (ViT)
"""
