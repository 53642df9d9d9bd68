#include "archive.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>

#include "errors.hpp"
#include "fd.hpp"
#include "zip_format.hpp"

namespace pyckpt {

using namespace zip;

namespace {

constexpr uint16_t kFlagEncrypted = 0x0001;
constexpr uint16_t kFlagStrongEncryption = 0x0040;
constexpr uint16_t kFlagDataDescriptor = 0x0008;
constexpr uint16_t kFlagMaskedHeaders = 0x2000;  // central directory encryption
constexpr uint32_t kDosDirectory = 0x10;         // MS-DOS attribute byte of the external attributes

std::string num(uint64_t v) { return std::to_string(v); }

}  // namespace

Archive::Archive(std::string path) : path_(std::move(path)) {
    open_mapped();
    parse();
    check_unchanged();
}

Archive::Archive(std::string path, uint64_t read_limit) : path_(std::move(path)) {
    uint64_t size = 0;
    UniqueFd fd = open_regular_file(path_, size);  // the same refusals as a mapped archive's
    if (size > read_limit) {
        fd.reset();
        open_mapped();
    } else {
        read_in(fd.get(), 0, size);
    }
    parse();
    check_unchanged();
}

Archive::Archive(std::string path, uint64_t base, uint64_t length, uint64_t read_limit) : path_(std::move(path)) {
    uint64_t size = 0;
    UniqueFd fd = open_regular_file(path_, size);
    if (base > size || length > size - base)
        fail("archive at bytes [" + num(base) + ", " + num(base) + "+" + num(length) + ") lies past the end of the " +
             num(size) + "-byte file");
    if (length > read_limit) {
        fd.reset();
        open_mapped();
        if (size_ < base + length) throw source_changed_error(path_);
        data_ += base;
        size_ = length;
    } else {
        read_in(fd.get(), base, length);
    }
    base_ = base;
    parse();
    check_unchanged();
    // parse() worked in the window's own offsets; callers get the file's.
    for (ArchiveMember& m : members_) {
        m.header_offset += base_;
        m.data_offset += base_;
    }
}

void Archive::read_in(int fd, uint64_t offset, uint64_t size) {
    held_.resize(size);
    uint64_t got = 0;
    while (got < size) {
        ssize_t n = ::pread(fd, held_.data() + got, size - got, static_cast<off_t>(offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) throw_errno("read", path_);
        if (n == 0) throw source_changed_error(path_);
        got += static_cast<uint64_t>(n);
    }
    size_ = size;
    data_ = reinterpret_cast<const uint8_t*>(held_.data());
}

void Archive::open_mapped() {
    // Parsing reads the end records, the central directory and one local header per member:
    // a few scattered pages that must not each drag in a readahead window.
    map_ = std::make_unique<MappedFile>(path_, /*random_access=*/true);
    size_ = map_->size();
    data_ = map_->data();
}

void Archive::check_unchanged() const {
    if (map_ && map_->changed())
        throw SourceChangedError(escape_bytes(path_) +
                                 ": became shorter while it was being read (changed by another process?)");
}

void Archive::fail(std::string_view what) const { throw archive_error(path_, what); }
void Archive::fail(std::string_view member, std::string_view what) const {
    throw archive_error(path_, member, what);
}

// The ZIP64 extra field holds 8-byte values only for the header fields saturated at 0xFFFFFFFF,
// in the fixed order size, compressed size, local header offset; `slots` lists the fields this
// header has, in that order. Returns whether the field was present.
bool Archive::read_zip64_extra(const uint8_t* x, uint64_t len, std::initializer_list<uint64_t*> slots,
                               std::string_view member, const char* where) const {
    const uint8_t* x_end = x + len;
    bool found = false;
    while (x_end - x >= 4) {
        uint16_t id = rd16(x), field_len = rd16(x + 2);
        if (x_end - x - 4 < field_len) fail(member, std::string("truncated extra field in ") + where);
        if (id == kZip64ExtraId) {
            const uint8_t* v = x + 4;
            uint64_t avail = field_len;
            for (uint64_t* slot : slots) {
                if (*slot != kMax32) continue;
                if (avail < 8) fail(member, std::string("truncated ZIP64 extra field in ") + where);
                *slot = rd64(v);
                v += 8;
                avail -= 8;
            }
            found = true;
        }
        x += 4 + field_len;
    }
    return found;
}

void Archive::parse() {
    const uint8_t* f = data_;
    const uint64_t n = size_;
    if (n < kEocdSize)
        fail("file too short to be a ZIP archive (" + num(n) + " bytes, no end-of-central-directory record)");

    // The end record sits at the very end unless an archive comment follows it; scan back over
    // at most the largest possible comment.
    uint64_t eocd = UINT64_MAX;
    const uint64_t lowest = n - kEocdSize > kMax16 ? n - kEocdSize - kMax16 : 0;
    for (uint64_t pos = n - kEocdSize + 1; pos-- > lowest;) {
        if (rd32(f + pos) == kEocdSig && pos + kEocdSize + rd16(f + pos + 20) <= n) {
            eocd = pos;
            break;
        }
    }
    if (eocd == UINT64_MAX) fail("no end-of-central-directory record (not a ZIP archive or truncated)");

    const uint8_t* e = f + eocd;
    uint64_t disk = rd16(e + 4), cd_disk = rd16(e + 6);
    uint64_t entries_here = rd16(e + 8), entries = rd16(e + 10);
    uint64_t cd_size = rd32(e + 12), cd_offset = rd32(e + 16);
    uint64_t cd_limit = eocd;  // the central directory must end before the end records

    bool has_locator = eocd >= kEocd64LocatorSize && rd32(f + eocd - kEocd64LocatorSize) == kEocd64LocatorSig;
    if (has_locator) {
        const uint8_t* loc = f + eocd - kEocd64LocatorSize;
        uint64_t rec = rd64(loc + 8);
        if (rd32(loc + 16) > 1) fail("multi-disk ZIP64 archives are not supported");
        if (rec > eocd - kEocd64LocatorSize || eocd - kEocd64LocatorSize - rec < kEocd64Size)
            fail("truncated ZIP64 end-of-central-directory record (offset " + num(rec) + ")");
        const uint8_t* z = f + rec;
        if (rd32(z) != kEocd64Sig) fail("bad ZIP64 end-of-central-directory signature at offset " + num(rec));
        // torch writes both end records with real values; a plain field that is not the ZIP64
        // sentinel must agree with its ZIP64 twin, or one of the two records is corrupt.
        auto agree = [&](uint64_t plain, uint64_t sentinel, uint64_t wide, const char* what) {
            if (plain != sentinel && plain != wide)
                fail(std::string("end-of-central-directory records disagree on the ") + what + " (" + num(plain) +
                     " vs ZIP64 " + num(wide) + ")");
        };
        agree(entries, kMax16, rd64(z + 32), "entry count");
        agree(cd_size, kMax32, rd64(z + 40), "central directory size");
        agree(cd_offset, kMax32, rd64(z + 48), "central directory offset");
        disk = rd32(z + 16);
        cd_disk = rd32(z + 20);
        entries_here = rd64(z + 24);
        entries = rd64(z + 32);
        cd_size = rd64(z + 40);
        cd_offset = rd64(z + 48);
        cd_limit = rec;
    } else if (entries == kMax16 || cd_size == kMax32 || cd_offset == kMax32) {
        fail("end-of-central-directory record requires ZIP64 but the ZIP64 locator is missing");
    }
    if (disk != 0 || cd_disk != 0 || entries_here != entries) fail("multi-disk ZIP archives are not supported");
    if (cd_offset > n || cd_size > n - cd_offset)
        fail("central directory past end of file (offset " + num(cd_offset) + ", size " + num(cd_size) +
             ", file size " + num(n) + ")");
    if (cd_offset + cd_size > cd_limit) fail("central directory overlaps the end-of-central-directory records");
    // Each entry needs at least the fixed header, which bounds the count before we reserve.
    if (entries > cd_size / kCentralHeaderSize)
        fail("central directory too small for " + num(entries) + " entries");

    members_.reserve(entries);
    uint64_t pos = cd_offset;
    const uint64_t cd_end = cd_offset + cd_size;
    for (uint64_t i = 0; i < entries; ++i) {
        if (cd_end - pos < kCentralHeaderSize)
            fail("truncated central directory at entry " + num(i));
        const uint8_t* c = f + pos;
        if (rd32(c) != kCentralSig) fail("bad central directory signature at offset " + num(pos));
        uint16_t flags = rd16(c + 8), method = rd16(c + 10);
        uint32_t crc = rd32(c + 16);
        uint64_t csize = rd32(c + 20), usize = rd32(c + 24);
        uint16_t name_len = rd16(c + 28), extra_len = rd16(c + 30), comment_len = rd16(c + 32);
        uint64_t lho = rd32(c + 42);
        uint64_t var_len = uint64_t{name_len} + extra_len + comment_len;
        if (cd_end - pos - kCentralHeaderSize < var_len)
            fail("truncated central directory at entry " + num(i));
        std::string name(reinterpret_cast<const char*>(c + kCentralHeaderSize), name_len);
        // Names reach error messages and lookups by Python str: refuse what cannot be either
        // (the escaped form keeps the message on one line).
        if (!is_clean_utf8(name))
            fail(name, "member name is not UTF-8 text without control characters");

        // ZIP64 extra: only the saturated slots are present, in the order usize, csize, offset.
        bool need64 = usize == kMax32 || csize == kMax32 || lho == kMax32;
        bool got64 = read_zip64_extra(c + kCentralHeaderSize + name_len, extra_len, {&usize, &csize, &lho}, name,
                                      "central directory");
        if (need64 && !got64) fail(name, "missing ZIP64 extra field in central directory");

        if (flags & (kFlagEncrypted | kFlagStrongEncryption | kFlagMaskedHeaders)) fail(name, "member is encrypted");
        // Fields torch's own reader refuses or acts on: a copy of this file must load in torch too.
        if (rd16(c + 34) != 0) fail(name, "member starts on disk " + num(rd16(c + 34)) + "; multi-disk archives are not supported");
        if (rd32(c + 38) & kDosDirectory) fail(name, "member is marked as a directory");
        if (method != 0) fail(name, "member is compressed (method " + num(method) + "); only stored members are supported");
        if (csize != usize) fail(name, "stored member has compressed size " + num(csize) + " != size " + num(usize));

        // Local header: the data offset depends on its own name/extra lengths, which may differ
        // from the central directory's.
        if (lho > n || n - lho < kLocalHeaderSize) fail(name, "local header past end of file (offset " + num(lho) + ")");
        const uint8_t* l = f + lho;
        if (rd32(l) != kLocalSig) fail(name, "bad local header signature at offset " + num(lho));
        uint16_t l_flags = rd16(l + 6), l_method = rd16(l + 8);
        uint16_t l_name_len = rd16(l + 26), l_extra_len = rd16(l + 28);
        if (n - lho - kLocalHeaderSize < uint64_t{l_name_len} + l_extra_len)
            fail(name, "local header past end of file");
        if (std::string_view(reinterpret_cast<const char*>(l + kLocalHeaderSize), l_name_len) != name)
            fail(name, "local header name mismatch ('" +
                           escape_bytes(std::string_view(reinterpret_cast<const char*>(l + kLocalHeaderSize), l_name_len)) +
                           "')");
        if (l_method != 0) fail(name, "member is compressed in its local header (method " + num(l_method) + ")");
        if (l_flags & (kFlagEncrypted | kFlagStrongEncryption)) fail(name, "member is encrypted");
        if (!(l_flags & kFlagDataDescriptor)) {
            uint64_t l_csize = rd32(l + 18), l_usize = rd32(l + 22);
            read_zip64_extra(l + kLocalHeaderSize + l_name_len, l_extra_len, {&l_usize, &l_csize}, name,
                             "local header");
            if (l_usize != usize || l_csize != csize)
                fail(name, "local header size " + num(l_usize) + " disagrees with central directory size " + num(usize));
        }
        uint64_t data_offset = lho + kLocalHeaderSize + l_name_len + l_extra_len;
        if (data_offset > n || n - data_offset < usize)
            fail(name, "member data past end of file (offset " + num(data_offset) + ", size " + num(usize) +
                           ", file size " + num(n) + ")");
        if (data_offset + usize > cd_offset)
            fail(name, "member data overlaps the central directory");

        members_.push_back(ArchiveMember{std::move(name), lho, data_offset, usize, crc});
        pos += kCentralHeaderSize + var_len;
    }

    // Overlap check over [local header, data end): catches crafted archives whose entries alias
    // each other, which would otherwise make two tensors share bytes silently.
    std::vector<std::size_t> order(members_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
        return members_[a].header_offset < members_[b].header_offset;
    });
    for (std::size_t k = 1; k < order.size(); ++k) {
        const ArchiveMember& a = members_[order[k - 1]];
        const ArchiveMember& b = members_[order[k]];
        if (a.data_offset + a.size > b.header_offset)
            fail(b.name, "overlaps member '" + a.name + "' (data ranges [" + num(a.header_offset) + ", " +
                             num(a.data_offset + a.size) + ") and [" + num(b.header_offset) + ", " +
                             num(b.data_offset + b.size) + "))");
    }

    index_.reserve(members_.size());
    for (std::size_t i = 0; i < members_.size(); ++i) {
        if (!index_.emplace(members_[i].name, i).second) fail(members_[i].name, "duplicate member name");
    }
}

const ArchiveMember& Archive::member(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end())
        throw MemberNotFound(escape_bytes(path_) + ": no member named '" + escape_bytes(name) + "'");
    return members_[it->second];
}

const uint8_t* Archive::member_data(const ArchiveMember& m) const {
    if (!data_) throw std::logic_error(path_ + ": archive is closed");
    return data_ + (m.data_offset - base_);
}

std::string Archive::prefix() const {
    if (members_.empty()) fail("archive has no members, so no top-level folder");
    std::string_view first = members_[0].name;
    auto slash = first.find('/');
    if (slash == std::string_view::npos || slash == 0)
        fail(members_[0].name, "member is not inside a top-level folder");
    std::string_view pre = first.substr(0, slash + 1);
    for (const auto& m : members_) {
        if (std::string_view(m.name).substr(0, pre.size()) != pre)
            fail(m.name, "member is not inside the top-level folder '" + std::string(first.substr(0, slash)) + "'");
    }
    return std::string(first.substr(0, slash));
}

void Archive::close() noexcept {
    map_.reset();
    std::string().swap(held_);
    data_ = nullptr;
}

}  // namespace pyckpt
