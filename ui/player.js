// Gapless low-latency PCM player for the app's latency panels (see ui/latency.py, ui/pcm_stream.py).
//
// At the Generate click the player makes a run id, opens that run's PCM stream with fetch() and
// schedules every chunk back to back on one AudioContext as its bytes arrive, so playback starts
// with the first chunk and no encoder sits between the model and the speaker.
//
// Why it is built this way (each cost measured in headless Chromium):
// - The AudioContext is created at page load: creating it inside the click costs 55-70 ms.
//   The click only resume()s it, which a browser allows in a user gesture.
// - It runs at the model's 24 kHz, so the browser resamples one continuous stream instead of every
//   chunk separately (per-chunk resampling can click at chunk boundaries).
// - The stream is read with fetch(), not through a Gradio component: component values that
//   arrive close together are coalesced by the page's reactivity, which dropped chunks.
// - stop() aborts the stream and stops audio already scheduled, which would otherwise play on.
(() => {
  if (window.qwenTTS) return; // the head script can be injected again on hot reload
  const SAMPLE_RATE = 24000;
  const context = new (window.AudioContext || window.webkitAudioContext)({ sampleRate: SAMPLE_RATE, latencyHint: "interactive" });
  // One render quantum (128 samples) of lead: a start time in the past plays at once but lets the
  // next chunk overlap this one's end by up to a quantum.
  const LEAD = 128 / SAMPLE_RATE;

  // performance.now() at which context time `t` reaches the speaker.
  function soundTime(t) {
    const stamp = context.getOutputTimestamp ? context.getOutputTimestamp() : {};
    if (stamp.performanceTime) return stamp.performanceTime + (t - stamp.contextTime) * 1000;
    const latency = (context.outputLatency || 0) + (context.baseLatency || 0);
    return performance.now() + (t - context.currentTime + latency) * 1000;
  }

  class PcmPlayer {
    constructor(name) {
      this.name = name;
      this.sources = new Set();
      this.abort = null;
      this.clickAt = null;
      this.stats = null;
    }

    // The Generate click (a user gesture): unlock audio, silence the last run, open the new run's stream.
    arm(urlPrefix) {
      context.resume();
      const clickAt = this.clickAt ?? performance.now();
      this.stop();
      this.clickAt = clickAt;
      const run = `${this.name}-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
      this.nextTime = 0;
      this.timeline = [];
      this.stats = { run, chunks: 0, seconds: 0, gaps: 0, scheduledMs: null, soundMs: null, done: false };
      this.show("waiting for the first chunk…");
      this.reveal();
      this.abort = new AbortController();
      this.read(new URL(urlPrefix + run, document.baseURI), this.abort.signal, this.stats);
      return run;
    }

    async read(url, signal, stats) {
      let pending = new Uint8Array(0);
      try {
        const response = await fetch(url, { signal, cache: "no-store" });
        if (!response.ok) {  // 404: the run never started; 429: this client has too many streams open
          const refusal = await response.json().catch(() => ({}));
          if (this.stats === stats) this.show(`no live audio: ${refusal.error?.message ?? response.status}`);
          return;
        }
        const reader = response.body.getReader();
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          pending = pending.length ? concat(pending, value) : value;
          // Frames: 4-byte little-endian length, then that many bytes of 16-bit PCM (0 = heartbeat).
          while (pending.length >= 4) {
            const length = new DataView(pending.buffer, pending.byteOffset, 4).getUint32(0, true);
            if (pending.length < 4 + length) break;
            if (length) this.schedule(pending.slice(4, 4 + length), stats);
            pending = pending.subarray(4 + length);
          }
        }
      } catch (error) {
        if (error.name !== "AbortError") console.error("PCM stream failed", error);
        return;
      }
      if (this.stats === stats) {
        stats.done = true;
        this.show(stats.chunks ? this.summary() + " · done" : "no audio (see the message above)");
      }
    }

    schedule(bytes, stats) {
      if (this.stats !== stats) return; // a stopped run's last bytes
      const pcm = new Int16Array(bytes.buffer, bytes.byteOffset, bytes.length >> 1);
      const samples = new Float32Array(pcm.length);
      for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 32768;
      const buffer = context.createBuffer(1, samples.length, SAMPLE_RATE);
      buffer.copyToChannel(samples, 0);
      const source = context.createBufferSource();
      source.buffer = buffer;
      source.connect(context.destination);
      let at = this.nextTime;
      if (at < context.currentTime + LEAD) {
        if (stats.chunks > 0) stats.gaps += 1; // the chunk came after the audio before it had ended
        at = context.currentTime + LEAD;
      }
      source.start(at);
      this.timeline.push({ at, offset: stats.seconds, duration: buffer.duration });
      this.nextTime = at + buffer.duration;
      this.sources.add(source);
      source.onended = () => this.sources.delete(source);
      if (stats.chunks === 0) {
        stats.scheduledMs = performance.now() - this.clickAt;
        stats.soundMs = soundTime(at) - this.clickAt;
      }
      stats.chunks += 1;
      stats.seconds += buffer.duration;
      this.show(this.summary());
      if (stats.chunks === 1) this.reveal(); // again: the page may have moved while the run waited, and the line grew
    }

    // Returns the id of the run it stopped ("" if none), for the server to stop that run.
    stop() {
      const run = this.stats ? this.stats.run : "";
      if (this.abort) this.abort.abort();
      this.abort = null;
      for (const source of this.sources) {
        try { source.stop(); } catch (e) { /* never started */ }
      }
      this.sources.clear();
      if (this.stats && !this.stats.done) {
        this.stats.done = true;
        this.show(this.summary() + " · stopped");
      }
      this.stats = null;
      this.clickAt = null;
      return run;
    }

    // What the streaming run has made so far, for the summary of a Stop; null when none is streaming.
    progress() {
      const s = this.stats;
      if (!s || s.done) return null;
      return { after_s: (performance.now() - this.clickAt) / 1000, audio_s: s.seconds, chunks: s.chunks };
    }

    // Seconds of the run's audio that have reached the speaker (-1 before the first sound or after Stop).
    position() {
      if (!this.stats || !this.timeline) return -1;
      const now = context.currentTime - (context.outputLatency || 0);
      let played = -1;
      for (const piece of this.timeline) {
        if (piece.at > now) break;
        played = piece.offset + Math.min(now - piece.at, piece.duration);
      }
      return played;
    }

    summary() {
      const s = this.stats;
      if (!s || !s.chunks) return "no audio yet";
      const gaps = s.gaps ? ` · ${s.gaps} gap${s.gaps > 1 ? "s" : ""} (chunks came late)` : " · gapless";
      return `first sound ${Math.round(s.soundMs)} ms after the click (scheduled at ${Math.round(s.scheduledMs)} ms) · ${s.seconds.toFixed(2)} s in ${s.chunks} chunks${gaps}`;
    }

    // Scroll the tab's live strip (player line, summary, seed) into view if any of it is off screen,
    // centred: its lines grow as the run's figures arrive.
    reveal() {
      const strip = document.getElementById(`${this.name}-strip`);
      if (!strip) return;
      const box = strip.getBoundingClientRect();
      if (box.top < 0 || box.bottom > window.innerHeight) strip.scrollIntoView({ block: "center" });
    }

    show(text) {
      const status = document.querySelector(`#${this.name}-player .pcm-status`);
      if (status) status.textContent = text;
    }
  }

  function concat(a, b) {
    const joined = new Uint8Array(a.length + b.length);
    joined.set(a);
    joined.set(b, a.length);
    return joined;
  }

  const players = new Map();
  function player(name) {
    if (!players.has(name)) players.set(name, new PcmPlayer(name));
    return players.get(name);
  }

  // Speech highlighting: in a `#NAME-live` element, the `.speech-token` span whose speech frames
  // (data-first..data-last, 80 ms each) are playing gets the class `speaking`. The audio runs
  // data-lead-s behind the frames (the vocoder's look-ahead, held back at the start of a stream).
  // A reply longer than its box scrolls inside it: the box follows the word being said.
  const FRAME_S = 0.08;
  function followInBox(span, holder) {
    let box = span.parentElement;
    while (box && box !== holder && box.scrollHeight <= box.clientHeight) box = box.parentElement;
    if (!box || box.scrollHeight <= box.clientHeight) return;
    const word = span.getBoundingClientRect(), view = box.getBoundingClientRect();
    if (word.top < view.top || word.bottom > view.bottom) box.scrollTop += word.top - view.top - (view.height - word.height) / 2;
  }
  setInterval(() => {
    for (const text of document.querySelectorAll('[id$="-live"] [data-lead-s]')) {
      const holder = text.closest('[id$="-live"]');
      const played = player(holder.id.replace(/-live$/, "")).position();
      const frame = played < 0 ? -1 : Math.floor((played + parseFloat(text.dataset.leadS)) / FRAME_S);
      for (const span of text.querySelectorAll(".speech-token")) {
        const on = frame >= +span.dataset.first && frame <= +span.dataset.last;
        if (on === span.classList.contains("speaking")) continue;
        span.classList.toggle("speaking", on);
        if (on) followInBox(span, holder);
      }
    }
  }, 50);

  // The click is timed in the capture phase, before any of Gradio's own handlers run.
  document.addEventListener("click", (event) => {
    const button = event.target.closest && event.target.closest(".pcm-generate");
    if (button) player(button.id.replace(/-generate$/, "")).clickAt = performance.now();
  }, true);

  window.qwenTTS = { context, player };
})();
