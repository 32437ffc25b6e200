// The chat page's client of POST /v1/chat/completions: a streamed request (SSE over POST,
// read with fetch and a stream reader) whose chunks arrive as an async iterator.

/** An answer that is not a reply: an HTTP error, an error event, or a broken stream. */
export class ChatError extends Error {
  constructor(message, status = null) {
    super(message);
    this.name = "ChatError";
    this.status = status;
  }
}

/** The headers of a JSON request, with ``Authorization`` when there is an API key. */
export function requestHeaders(apiKey) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  return headers;
}

/** The message of an error response: OpenAI's ``{"error": {"message"}}``, else its text. */
async function errorMessage(response) {
  const text = await response.text().catch(() => "");
  try {
    const message = JSON.parse(text).error?.message;
    if (message) return message;
  } catch {
    // not JSON: the text itself
  }
  return text.trim() || response.statusText || "request failed";
}

/** The JSON payloads of the complete SSE events in ``buffer``, and what is left of it. */
function takeEvents(buffer) {
  const events = buffer.split(/\r?\n\r?\n/);
  const rest = events.pop();
  const payloads = events
    .map((event) =>
      event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n"),
    )
    .filter((data) => data.length);
  return [payloads, rest];
}

/**
 * Stream a chat completion: yields each chunk (parsed JSON) until ``[DONE]``.
 *
 * Throws a ChatError for an HTTP error (with its status and the server's message), an error
 * event inside the stream, or a stream that ends before ``[DONE]``; an ``AbortError`` when
 * ``signal`` aborts (the server then stops generating and frees the request's KV blocks).
 */
export async function* streamChat(url, body, apiKey, signal) {
  let response;
  try {
    response = await fetch(url, {
      method: "POST",
      headers: requestHeaders(apiKey),
      body: JSON.stringify(body),
      signal,
    });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ChatError(`could not reach the server (${error.message})`);
  }
  if (!response.ok) {
    throw new ChatError(`${response.status}: ${await errorMessage(response)}`, response.status);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (error) {
        if (error.name === "AbortError") throw error;
        throw new ChatError(`the connection was lost (${error.message})`);
      }
      if (chunk.done) break;
      let payloads;
      [payloads, buffer] = takeEvents(buffer + decoder.decode(chunk.value, { stream: true }));
      for (const data of payloads) {
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ChatError(parsed.error.message || "error", parsed.error.code);
        yield parsed;
      }
    }
  } finally {
    reader.releaseLock();
  }
  throw new ChatError("the connection closed before the reply was complete");
}
