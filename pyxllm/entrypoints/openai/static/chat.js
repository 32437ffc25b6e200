// The chat page: conversations kept in localStorage, replies streamed from the server's
// POST /v1/chat/completions (api.js) and rendered as safe markdown (markdown.js).
//
// Every request carries a ``seed``: the one in Settings, else a new random one per reply (so
// answers still vary, and Regenerate gives another). The seed is shown under the reply, so a
// user can put it in Settings to get the same reply again (as llama.cpp's web UI lets one fix
// its seed); with the model's own sampling a fixed seed makes the first answer the same on
// every page load, which is what the browser tests check.

import { ChatError, requestHeaders, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const CHAT_URL = "v1/chat/completions";
const MODELS_URL = "v1/models";
const STORE = { conversations: "pyxllm-chat.conversations", settings: "pyxllm-chat.settings" };
const SETTING_NAMES = ["system_prompt", "temperature", "top_p", "max_tokens", "seed", "api_key", "extra"];
const NUMBER_SETTINGS = ["temperature", "top_p", "max_tokens", "seed"];
const SEED_RANGE = 2 ** 31; // the random seeds drawn: [0, 2**31), any JSON number and any server's

const $ = (id) => document.getElementById(id);
const ui = {
  app: $("app"),
  conversations: $("conversations"),
  messages: $("messages"),
  composer: $("composer"),
  prompt: $("prompt"),
  send: $("send"),
  stop: $("stop"),
  model: $("model-name"),
  notice: $("notice"),
  settings: $("settings"),
  settingsForm: $("settings-form"),
  settingsError: $("settings-error"),
  attachments: $("attachments"),
  attachInput: $("attach-input"),
};

const state = {
  conversations: [],
  currentId: null,
  settings: Object.fromEntries(SETTING_NAMES.map((name) => [name, ""])),
  controller: null, // the AbortController of the reply being streamed
  attachments: [], // data: URLs of the images the next message carries
};

// --- storage ---------------------------------------------------------------------------------

function readJSON(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  try {
    localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
    localStorage.setItem(STORE.settings, JSON.stringify(state.settings));
  } catch (error) {
    showNotice(`could not save the conversations (${error.message})`);
  }
}

function load() {
  const stored = readJSON(STORE.conversations, []);
  state.conversations = Array.isArray(stored) ? stored.filter((c) => Array.isArray(c?.messages)) : [];
  for (const message of state.conversations.flatMap((c) => c.messages)) {
    if (message.state === "waiting" || message.state === "streaming") message.state = "stopped";
  }
  Object.assign(state.settings, readJSON(STORE.settings, {}));
  state.currentId = state.conversations[0]?.id ?? null;
}

// --- conversations ---------------------------------------------------------------------------

function current() {
  return state.conversations.find((c) => c.id === state.currentId) ?? null;
}

function newConversation() {
  const conversation = { id: `${Date.now()}-${Math.random().toString(36).slice(2)}`, title: "", messages: [] };
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  return conversation;
}

function selectConversation(id) {
  stop();
  state.currentId = id;
  ui.app.classList.remove("sidebar-open");
  render();
}

function deleteConversation(id) {
  if (id === state.currentId) stop();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (id === state.currentId) state.currentId = state.conversations[0]?.id ?? null;
  save();
  render();
}

// --- rendering -------------------------------------------------------------------------------

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, className, onClick) {
  const node = element("button", className, label);
  node.type = "button";
  node.addEventListener("click", onClick);
  return node;
}

function showNotice(text) {
  ui.notice.textContent = text;
  ui.notice.hidden = !text;
}

function renderSidebar() {
  ui.conversations.replaceChildren(
    ...state.conversations.map((conversation) => {
      const item = element("li", conversation.id === state.currentId ? "current" : "");
      const open = button(conversation.title || "New chat", "open", () => selectConversation(conversation.id));
      item.append(open, button("×", "delete", () => deleteConversation(conversation.id)));
      item.lastChild.setAttribute("aria-label", "Delete this conversation");
      return item;
    }),
  );
}

/** "12 prompt + 16 tokens · 31.0 tok/s · TTFT 120 ms · seed 7" (what is known so far). */
function statsText(stats, seed) {
  if (!stats) return "";
  const parts = [];
  const tokens = `${stats.completion} token${stats.completion === 1 ? "" : "s"}`;
  parts.push(stats.prompt === undefined ? tokens : `${stats.prompt} prompt + ${tokens}`);
  if (stats.rate !== undefined) parts.push(`${stats.rate.toFixed(1)} tok/s`);
  if (stats.ttft !== undefined) parts.push(`TTFT ${Math.round(stats.ttft)} ms`);
  if (seed !== undefined) parts.push(`seed ${seed}`);
  return parts.join(" · ");
}

/** The parts of a message element, created once so that updates keep their state. */
function messageParts(node) {
  if (!node.parts) {
    const reasoning = element("details", "reasoning");
    reasoning.append(element("summary", "", "Reasoning"), element("div", "reasoning-text"));
    const meta = element("div", "meta");
    meta.append(element("span", "stats"), element("span", "actions"));
    const parts = {
      reasoning,
      content: element("div", "content"),
      tools: element("div", "tool-calls"),
      error: element("div", "error"),
      meta,
    };
    parts.error.setAttribute("role", "alert");
    node.append(parts.reasoning, parts.content, parts.tools, parts.error, parts.meta);
    node.parts = parts;
  }
  return node.parts;
}

/** Show ``message`` in ``node`` (its text, reasoning, tool calls, error and figures). */
function fillMessage(node, message) {
  const parts = messageParts(node);
  node.dataset.state = message.state ?? "done";
  if (message.role === "user") {
    parts.content.textContent = message.content;
    for (const url of message.images ?? []) {
      const image = element("img", "attached");
      image.src = url;
      image.alt = "attached image";
      parts.content.prepend(image);
    }
  } else {
    parts.content.innerHTML = renderMarkdown(message.content);
    if (message.state === "stopped") parts.content.append(element("span", "stopped", " (stopped)"));
  }
  parts.reasoning.hidden = !message.reasoning;
  parts.reasoning.lastChild.textContent = message.reasoning ?? "";
  parts.tools.replaceChildren(
    ...(message.tool_calls ?? []).map((call) => {
      const block = element("div", "tool-call");
      block.append(element("span", "tool-name", `tool call: ${call.name}`), element("pre", "", call.arguments));
      return block;
    }),
  );
  parts.error.hidden = !message.error;
  parts.error.textContent = message.error ?? "";
  const stats = parts.meta.querySelector(".stats");
  stats.textContent = statsText(message.stats, message.seed);
  if (message.stats) stats.dataset.completionTokens = message.stats.completion;
}

function messageActions(conversation, index) {
  const message = conversation.messages[index];
  const last = conversation.messages.length - 1;
  if (state.controller) return [];
  if (message.role === "assistant" && index === last) {
    return [
      button("Regenerate", "regenerate", () => regenerate(conversation)),
      button("Copy", "copy-reply", (event) => copyText(message.content, event.target)),
    ];
  }
  const lastUser = conversation.messages.findLastIndex((m) => m.role === "user");
  if (message.role === "user" && index === lastUser) {
    return [button("Edit", "edit", () => editMessage(conversation, index))];
  }
  return [];
}

function renderMessages() {
  const conversation = current();
  const nodes = (conversation?.messages ?? []).map((message, index) => {
    const node = element("div", `message ${message.role}`);
    fillMessage(node, message);
    node.parts.meta.querySelector(".actions").replaceChildren(...messageActions(conversation, index));
    return node;
  });
  ui.messages.replaceChildren(...nodes);
  if (!nodes.length) ui.messages.append(element("p", "empty", "Ask the model something."));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function render() {
  renderSidebar();
  renderMessages();
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
}

// --- talking to the server -------------------------------------------------------------------

function numberSettings() {
  const values = {};
  for (const name of NUMBER_SETTINGS) {
    const text = String(state.settings[name] ?? "").trim();
    if (text) values[name] = Number(text);
  }
  return values;
}

/** A seed for a reply when Settings fix none: uniform in [0, SEED_RANGE). */
function randomSeed() {
  return crypto.getRandomValues(new Uint32Array(1))[0] % SEED_RANGE;
}

/** The request for a reply to ``history``: a random seed, settings, extra fields, then the
 * messages (a later one wins: the seed of Settings or of the extra fields replaces the drawn one). */
function requestBody(history) {
  const messages = [];
  const system = state.settings.system_prompt?.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const message of history) {
    if (message.images?.length) {
      // OpenAI's content parts: the images, then the text (a vision-language model reads them)
      const parts = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
      if (message.content) parts.push({ type: "text", text: message.content });
      messages.push({ role: message.role, content: parts });
    } else if (message.role === "user" || message.content) {
      messages.push({ role: message.role, content: message.content });
    }
  }
  const extra = state.settings.extra?.trim() ? JSON.parse(state.settings.extra) : {};
  return {
    seed: randomSeed(),
    ...numberSettings(),
    ...extra,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
}

/** Tokens so far, time to first token and tokens/s after the first, from stream timings. */
function figures(timing, usage) {
  const completion = usage?.completion_tokens ?? timing.pieces;
  const stats = { completion };
  if (usage) stats.prompt = usage.prompt_tokens;
  if (timing.first !== null) {
    stats.ttft = timing.first - timing.started;
    const seconds = (performance.now() - timing.first) / 1000;
    if (completion > 1 && seconds > 0) stats.rate = (completion - 1) / seconds;
  }
  return stats;
}

function mergeToolCalls(calls, deltas) {
  for (const delta of deltas) {
    const index = delta.index ?? calls.length;
    calls[index] ??= { name: "", arguments: "" };
    calls[index].name += delta.function?.name ?? "";
    calls[index].arguments += delta.function?.arguments ?? "";
  }
}

/** Add what one streamed chunk says to ``reply``; whether it carried any output. */
function applyChunk(reply, chunk) {
  if (chunk.usage) reply.usage = chunk.usage;
  let output = false;
  for (const choice of chunk.choices ?? []) {
    const delta = choice.delta ?? {};
    const reasoning = delta.reasoning_content ?? delta.reasoning;
    if (delta.content) reply.content += delta.content;
    if (reasoning) reply.reasoning += reasoning;
    if (delta.tool_calls) mergeToolCalls(reply.tool_calls, delta.tool_calls);
    output ||= Boolean(delta.content || reasoning || delta.tool_calls);
  }
  return output;
}

/** Stream the assistant's reply to the end of ``conversation`` into a new message. */
async function generate(conversation) {
  const reply = { role: "assistant", content: "", reasoning: "", tool_calls: [], state: "waiting" };
  let body;
  try {
    body = requestBody(conversation.messages);
  } catch (error) {
    reply.state = "error";
    reply.error = `the extra request fields in Settings are not JSON (${error.message})`;
  }
  if (body) reply.seed = body.seed;
  conversation.messages.push(reply);
  save();
  if (!body) return render();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  render();
  const node = ui.messages.lastElementChild;
  const timing = { started: performance.now(), first: null, pieces: 0 };
  let frame = null;
  const show = () => {
    frame = null;
    const atBottom = ui.messages.scrollHeight - ui.messages.scrollTop - ui.messages.clientHeight < 80;
    reply.stats = figures(timing, reply.usage);
    fillMessage(node, reply);
    if (atBottom) ui.messages.scrollTop = ui.messages.scrollHeight;
  };
  try {
    for await (const chunk of streamChat(CHAT_URL, body, state.settings.api_key, controller.signal)) {
      if (applyChunk(reply, chunk)) {
        timing.pieces += 1;
        timing.first ??= performance.now();
        reply.state = "streaming";
      }
      frame ??= requestAnimationFrame(show);
    }
    reply.state = "done";
  } catch (error) {
    reply.state = error.name === "AbortError" ? "stopped" : "error";
    if (reply.state === "error") reply.error = error instanceof ChatError ? error.message : String(error);
  } finally {
    if (frame !== null) cancelAnimationFrame(frame);
    reply.stats = figures(timing, reply.usage);
    if (state.controller === controller) state.controller = null;
    setBusy(Boolean(state.controller));
    save();
    if (current() === conversation) render();
  }
}

function stop() {
  state.controller?.abort();
}

function send(text) {
  if (state.controller || (!text.trim() && !state.attachments.length)) return;
  const conversation = current() ?? newConversation();
  const message = { role: "user", content: text };
  if (state.attachments.length) message.images = state.attachments.splice(0);
  conversation.messages.push(message);
  conversation.title ||= text.trim().slice(0, 60) || "Image";
  ui.prompt.value = "";
  fitPrompt();
  renderAttachments();
  generate(conversation);
}

function regenerate(conversation) {
  if (conversation.messages.at(-1)?.role === "assistant") conversation.messages.pop();
  generate(conversation);
}

function editMessage(conversation, index) {
  const node = ui.messages.children[index];
  const area = element("textarea", "edit-text");
  area.value = conversation.messages[index].content;
  const submit = () => {
    if (!area.value.trim()) return;
    conversation.messages[index].content = area.value;
    conversation.messages.length = index + 1;
    if (index === 0) conversation.title = area.value.trim().slice(0, 60);
    generate(conversation);
  };
  area.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      submit();
    } else if (event.key === "Escape") renderMessages();
  });
  const actions = node.parts.meta.querySelector(".actions");
  actions.replaceChildren(button("Send", "edit-send", submit), button("Cancel", "edit-cancel", renderMessages));
  node.parts.content.replaceChildren(area);
  area.focus();
}

async function copyText(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API outside a secure context (http on another host): the old way
    const area = element("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = target.textContent;
  target.textContent = "Copied";
  setTimeout(() => (target.textContent = label), 1200);
}

/** Show the served model's name, or why the API cannot be reached. */
async function showModel() {
  try {
    const response = await fetch(MODELS_URL, { headers: requestHeaders(state.settings.api_key) });
    if (response.status === 401) {
      ui.model.textContent = "pyxllm";
      return showNotice("This server needs an API key: enter it in Settings.");
    }
    const models = await response.json();
    ui.model.textContent = models.data?.[0]?.id ?? "pyxllm";
    showNotice("");
  } catch (error) {
    showNotice(`The server cannot be reached (${error.message}).`);
  }
}

// --- settings --------------------------------------------------------------------------------

function openSettings() {
  for (const name of SETTING_NAMES) ui.settingsForm.elements[name].value = state.settings[name] ?? "";
  ui.settingsError.textContent = "";
  ui.settings.showModal();
}

function saveSettings(event) {
  event.preventDefault();
  const values = Object.fromEntries(SETTING_NAMES.map((name) => [name, ui.settingsForm.elements[name].value]));
  if (values.extra.trim()) {
    let extra;
    try {
      extra = JSON.parse(values.extra);
    } catch (error) {
      ui.settingsError.textContent = `Extra request fields: not JSON (${error.message})`;
      return;
    }
    if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {
      ui.settingsError.textContent = "Extra request fields: give a JSON object, {...}";
      return;
    }
  }
  Object.assign(state.settings, values);
  save();
  ui.settings.close();
  showModel();
}

// --- the composer ----------------------------------------------------------------------------

/** Show the images the next message carries, each with a button that removes it. */
function renderAttachments() {
  ui.attachments.hidden = !state.attachments.length;
  ui.attachments.replaceChildren(
    ...state.attachments.map((url, index) => {
      const item = element("span", "attachment");
      const image = element("img", "");
      image.src = url;
      image.alt = `image ${index + 1}`;
      const remove = button("×", "remove-attachment", () => {
        state.attachments.splice(index, 1);
        renderAttachments();
      });
      remove.setAttribute("aria-label", `remove image ${index + 1}`);
      item.append(image, remove);
      return item;
    }),
  );
}

/** Attach the image files among ``files`` (pasted, dropped or chosen) as data: URLs; says so
 * when some are not images. */
function attachFiles(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  const skipped = files.length - images.length;
  if (skipped) showNotice(`only images can be attached (${skipped} other file${skipped > 1 ? "s" : ""} left out)`);
  for (const file of images) {
    const reader = new FileReader();
    reader.addEventListener("load", () => {
      state.attachments.push(reader.result);
      renderAttachments();
    });
    reader.readAsDataURL(file);
  }
  return images.length > 0;
}

function fitPrompt() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 200)}px`;
  ui.prompt.style.overflowY = ui.prompt.scrollHeight > 200 ? "auto" : "hidden";
}

function start() {
  load();
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send(ui.prompt.value);
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send(ui.prompt.value);
    }
  });
  ui.prompt.addEventListener("input", fitPrompt);
  ui.prompt.addEventListener("paste", (event) => {
    if (attachFiles(event.clipboardData?.files ?? [])) event.preventDefault();
  });
  ui.composer.addEventListener("dragover", (event) => event.preventDefault());
  ui.composer.addEventListener("drop", (event) => {
    event.preventDefault();
    attachFiles(event.dataTransfer?.files ?? []);
  });
  $("attach").addEventListener("click", () => ui.attachInput.click());
  ui.attachInput.addEventListener("change", () => {
    attachFiles(ui.attachInput.files);
    ui.attachInput.value = "";
  });
  ui.stop.addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    stop();
    newConversation();
    save();
    render();
    ui.app.classList.remove("sidebar-open");
    ui.prompt.focus();
  });
  $("toggle-sidebar").addEventListener("click", () => ui.app.classList.toggle("sidebar-open"));
  $("open-settings").addEventListener("click", openSettings);
  $("cancel-settings").addEventListener("click", () => ui.settings.close());
  ui.settingsForm.addEventListener("submit", saveSettings);
  ui.messages.addEventListener("click", (event) => {
    const copy = event.target.closest(".code-block .copy");
    if (copy) copyText(copy.closest(".code-block").querySelector("code").textContent, copy);
  });
  render();
  showModel();
  ui.prompt.focus();
}

// the page's renderer, for whoever wants to check it from the console (and the tests)
window.pyxllm = { renderMarkdown };
start();
