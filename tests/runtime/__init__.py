"""gpt2edge.runtime: the Generator API, model/, decoding/, speculative/, constraints/, sparse_head/, score, sessions."""
