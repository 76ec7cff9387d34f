"""The OpenAI-compatible face (docs/OPENAI.md): /v1/models, /v1/completions and
/v1/chat/completions for the generators that declare a tokenizer, on the HTTP face's port.

face.py: the routes, auth and streaming (server-sent events); translate.py: an OpenAI request
into the generations it asks for, and their outputs into OpenAI's JSON; text.py: token ids into
text as they stream (partial characters and stop strings held back); chat.py: the chat
template; errors.py: errors in OpenAI's shape. Generations go through the DoorPort as every
face's requests do.
"""
