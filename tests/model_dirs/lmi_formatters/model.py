"""Custom pre- and post-processing for the built-in vLLM handler, as LMI documents it:
no handle(), only an @input_formatter and an @output_formatter. Clients send
{"question": ...}; they get {"answer": ...} (or {"t": ...} lines when streaming)."""

from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter


@input_formatter
def question_to_prompt(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    if "question" not in decoded_payload:
        raise ValueError("send a 'question'")
    assert tokenizer is not None and tokenizer.encode("Q:")  # the engine's tokenizer is passed in
    return {"inputs": f"Q: {decoded_payload['question']} A:", "parameters": {"max_new_tokens": 6, "ignore_eos": True},
            "stream": bool(decoded_payload.get("stream"))}


@output_formatter
def answer_only(response_data: dict) -> dict:
    if "token" in response_data:  # one line of a stream
        return {"t": response_data["token"]["text"]}
    return {"answer": response_data["generated_text"]}
