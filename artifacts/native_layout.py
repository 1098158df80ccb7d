"""The layout of ``native_weights.safetensors``: the native decoder's weights, beside a genai export's graph.

``prunus export`` writes it (:mod:`prunus.export.native_weights`) from the tensors the graph is built from: the
model dir's stored int8 / int4 codes and scales, its float weights, and for a float model exported at int8 /
int4 the codes ONNX Runtime's quantizer computes for the graph. The native decoder reads it
(:mod:`prunus.native.weights`), so it needs neither the graph nor the model dir. Both sides take the names here.

Tensors, float32 unless said:

* ``tok_embeddings.weight`` (vocab, dim), ``norm.weight`` (dim,), ``rope.cos`` / ``rope.sin``
  (positions, head_dim / 2), ``layers.{i}.attention_norm.weight`` and ``layers.{i}.ffn_norm.weight`` (dim,);
* one linear layer per prefix (:data:`ATTENTION`, :data:`FEED_FORWARD` under ``layers.{i}.attention.`` /
  ``layers.{i}.feed_forward.``, and ``output``): exactly one of ``.weight`` (out, in) float32, ``.q8`` (out, in)
  uint8 codes whose zero point is 128, ``.q4`` (out, in / 2) uint8, two codes a byte, low nibble first, zero
  point 8; with codes, ``.scale`` (out, in / block) and optionally ``.zero`` (out, in / block) uint8 zero points;
  optionally ``.bias`` (out,). A weight is (code - zero) * scale.

``__metadata__`` (strings): ``format`` (:data:`NATIVE_FORMAT`), ``n_heads``, ``eps``, ``scale`` (the attention
scale), ``windows`` (one sliding window per layer, comma-separated, -1 for none), ``tied_head`` ("true": the head
is the embedding read transposed, and no ``output`` tensors are stored). An export whose graph the kernels do not
mirror (int8 as QDQ or ``DynamicQuantizeMatMul``, float zero points, ...) stores no tensors and ``unsupported``:
why, so that ``--native`` names it.
"""

NATIVE_WEIGHTS = "native_weights.safetensors"
NATIVE_FORMAT = "prunus-native/1"
ATTENTION = ("wqkv", "wq", "wk", "wv", "wo")
FEED_FORWARD = ("w13", "w1", "w3", "w2")
KINDS = ("weight", "q8", "q4")  # the suffix that holds a linear layer's values: float, int8 or int4 codes
