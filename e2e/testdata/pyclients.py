"""The official OpenAI and Anthropic Python clients' ordinary calls, through
pdx: run by e2e's TestPythonClients with the stack's URL, the model and the
prompts as a JSON object on argv; prints what each call answered, as JSON.
"""

import json
import sys

import anthropic
import openai


def main() -> None:
    url, model, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    out = {}

    r = oa.responses.create(model=model, input=prompts["responses.create"], max_output_tokens=4)
    out["responses.create"] = {"text": r.output_text, "status": r.status,
                               "input_tokens": r.usage.input_tokens if r.usage else None}

    with oa.responses.stream(model=model, input=prompts["responses.stream"], max_output_tokens=4) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    out["responses.stream"] = {"text": "".join(deltas), "final": final.output_text, "status": final.status}

    m = an.messages.create(model=model, max_tokens=4,
                           messages=[{"role": "user", "content": prompts["messages.create"]}])
    out["messages.create"] = {"text": m.content[0].text, "stop_reason": m.stop_reason,
                              "input_tokens": m.usage.input_tokens}

    with an.messages.stream(model=model, max_tokens=4,
                            messages=[{"role": "user", "content": prompts["messages.stream"]}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    out["messages.stream"] = {"text": text, "final": final.content[0].text, "stop_reason": final.stop_reason}

    # Errors arrive as each client's own exceptions.
    try:
        an.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": "x"}])
        out["messages.error"] = None
    except anthropic.BadRequestError as e:
        out["messages.error"] = {"status": e.status_code, "type": e.body["error"]["type"] if isinstance(e.body, dict) else None}
    try:
        oa.responses.create(model=model, input="x", previous_response_id="resp_1")
        out["responses.error"] = None
    except openai.BadRequestError as e:
        out["responses.error"] = {"status": e.status_code, "code": e.code}

    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
