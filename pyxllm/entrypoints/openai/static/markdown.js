// A small, safe markdown renderer for model output (pyxllm's own; no library).
//
// The text is HTML-escaped first, and only then are a few constructs turned into tags this
// file writes itself: code fences (with a copy button), inline code, **bold**, *italic*,
// headings, bulleted and numbered lists, and [links](https://...) whose target is http(s).
// Nothing the model writes can become a tag or an attribute of its own choosing: every
// character of the text reaches the HTML as an entity or as plain text.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** The text with &, <, >, " and ' replaced by HTML entities. */
function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

const FENCE = /^\s{0,3}(```|~~~)\s*([\w+#.-]{0,32})/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}\d{1,9}[.)]\s+(.*)$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
// on escaped text: [label](http(s)://target), the target without spaces, quotes or brackets
const LINK = /\[([^\]\n]+)\]\((https?:\/\/[^\s()<>"']+)\)/g;
const STRONG = /(\*\*|__)(?=\S)(.+?)(?<=\S)\1/g;
const EMPHASIS = /(^|[^\w*])([*_])(?=\S)(.+?)(?<=\S)\2(?![\w*])/g;

/** Inline markdown of one escaped line segment outside code spans. */
function renderEmphasis(escaped) {
  return escaped
    .replace(STRONG, "<strong>$2</strong>")
    .replace(EMPHASIS, "$1<em>$3</em>");
}

/** Links and emphasis of one escaped segment outside code spans. */
function renderLinks(escaped) {
  let html = "";
  let last = 0;
  for (const match of escaped.matchAll(LINK)) {
    html += renderEmphasis(escaped.slice(last, match.index));
    const [, label, href] = match;
    html +=
      `<a href="${href}" target="_blank" rel="noopener noreferrer nofollow">` +
      `${renderEmphasis(label)}</a>`;
    last = match.index + match[0].length;
  }
  return html + renderEmphasis(escaped.slice(last));
}

/** Inline markdown of raw ``text``: `code` spans first (their content stays literal). */
function renderInline(text) {
  const parts = String(text).split(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/);
  let html = "";
  // split() with two groups gives: text, ticks, code, text, ticks, code, ..., text
  for (let i = 0; i < parts.length; i += 3) {
    html += renderLinks(escapeHtml(parts[i]));
    if (i + 2 < parts.length) html += `<code>${escapeHtml(parts[i + 2].trim())}</code>`;
  }
  return html;
}

/** A fenced code block with a header naming its language and a copy button. */
function renderCodeBlock(lang, lines) {
  const label = lang ? `<span class="lang">${escapeHtml(lang)}</span>` : "<span></span>";
  return (
    `<div class="code-block"><div class="code-head">${label}` +
    `<button type="button" class="copy" title="Copy the code">Copy</button></div>` +
    `<pre><code>${escapeHtml(lines.join("\n"))}</code></pre></div>`
  );
}

/** The HTML of markdown ``text``; safe to assign to innerHTML (see the file's header). */
export function renderMarkdown(text) {
  const lines = String(text ?? "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let paragraph = [];
  let list = null; // {tag, items}

  const flushParagraph = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${i}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  const addItem = (tag, content) => {
    flushParagraph();
    if (list && list.tag !== tag) flushList();
    list = list || { tag, items: [] };
    list.items.push(renderInline(content));
  };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushParagraph();
      flushList();
      const code = [];
      // an unclosed fence (a reply still streaming) runs to the end of the text
      while (++i < lines.length && !lines[i].trimStart().startsWith(fence[1])) code.push(lines[i]);
      out.push(renderCodeBlock(fence[2], code));
      continue;
    }
    let match;
    if ((match = BULLET.exec(line))) addItem("ul", match[1]);
    else if ((match = NUMBERED.exec(line))) addItem("ol", match[1]);
    else if ((match = HEADING.exec(line))) {
      flushParagraph();
      flushList();
      const level = Math.min(match[1].length + 2, 6);
      out.push(`<h${level}>${renderInline(match[2])}</h${level}>`);
    } else if (!line.trim()) {
      flushParagraph();
      flushList();
    } else if (list && /^\s{2,}\S/.test(line)) {
      list.items[list.items.length - 1] += ` ${renderInline(line.trim())}`;
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  flushParagraph();
  flushList();
  return out.join("");
}
